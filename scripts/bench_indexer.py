"""Per-layer benchmark of a level-2 index source (layers 24/28/32/36 of the release) on one GPU:

  day-zero   dense scores over every visible row (bf16 keys) + mask to the candidate blocks + torch.topk
  candidate  scores of the 2048 x 8 candidate rows only (Triton kernel, MXFP4 key records) + top-k in that
             compact space, remapped to row ids

    python scripts/bench_indexer.py [--quick]     (writes benchmarks/results/indexer-<date>.json)

Shapes are the release's: 32 index heads x 128, top-512, candidates 2048 blocks of 8, a ratio-1 source
(one key row per context token). Decode: batch 1/8/64, contexts 8K/128K/512K; prefill: one 4K-token
chunk. Also the top-k alone: top_k_stable (deterministic ties) vs torch.topk. Correctness first: the
kernel against the reference op, and both paths pick the same row sets (tie-free random scores).
"""

from __future__ import annotations

import argparse

import torch

from dsflash_compile.benchmarking import run_metadata, save_results, time_eager, time_graph
from dsflash_compile.custom_ops import records
from dsflash_compile.custom_ops.indexer import (candidate_rows, candidate_scores_reference, candidate_topk_reference,
                                                indexer_scores_reference)
from dsflash_compile.custom_ops.indexer_triton import candidate_scores_triton
from dsflash_compile.custom_ops.topk import top_k_stable

HEADS, DIM, TOPK, BLOCKS, BLOCK = 32, 128, 512, 2048, 8


def make_case(batch: int, context: int, seq: int, gen: torch.Generator) -> dict:
    q = torch.randn(batch, seq, HEADS, DIM, generator=gen, device="cuda").bfloat16()
    weights = (torch.randn(batch, seq, HEADS, generator=gen, device="cuda") * 0.05).bfloat16()
    keys_bf16 = records.decode_reference(
        records.encode_reference(torch.randn(batch, context, DIM, generator=gen, device="cuda").bfloat16(), "mxfp4"),
        "mxfp4", DIM)  # on the MXFP4 grid, so both paths see the same keys
    keys_mxfp4 = records.encode_reference(keys_bf16, "mxfp4")
    visible = torch.full((batch, seq), context, device="cuda") - torch.arange(seq, device="cuda").flip(0)
    n_blocks = -(-context // BLOCK)
    kept = min(BLOCKS, n_blocks)
    blocks = torch.rand(batch, seq, n_blocks, generator=gen, device="cuda").topk(kept, dim=-1).indices
    blocks = blocks.sort(-1).values.to(torch.int32)
    return dict(q=q, weights=weights, keys_bf16=keys_bf16, keys_mxfp4=keys_mxfp4, visible=visible, blocks=blocks,
                context=context)


def dense_path(case, query_chunk: int = 128) -> torch.Tensor:
    """Queries in chunks: the dense [queries, 32 heads, context] bf16 products of a 4K chunk at 512K
    context would need 137 GB at once."""
    context, picks = case["context"], []
    for s0 in range(0, case["q"].shape[1], query_chunk):
        sl = slice(s0, s0 + query_chunk)
        scores = indexer_scores_reference(case["q"][:, sl], case["weights"][:, sl], case["keys_bf16"],
                                          case["visible"][:, sl], context)
        rows = candidate_rows(case["blocks"][:, sl], BLOCK)
        mask = torch.zeros(*rows.shape[:-1], context + 1, dtype=torch.bool, device="cuda")
        mask.scatter_(-1, torch.where((rows >= 0) & (rows < context), rows, context), True)
        scores = scores.masked_fill(~mask[..., :-1], -torch.inf)
        picks.append(scores.topk(min(TOPK, context), dim=-1).indices.sort(-1).values)
    return torch.cat(picks, dim=1)


def candidate_path(case) -> torch.Tensor:
    scores = candidate_scores_triton(case["q"], case["weights"], case["keys_mxfp4"], case["blocks"], BLOCK,
                                     case["visible"], "mxfp4")
    return candidate_topk_reference(scores, case["blocks"], BLOCK, min(TOPK, case["context"]))


def check(gen) -> dict:
    case = make_case(2, 40000, 3, gen)
    ref = candidate_scores_reference(case["q"], case["weights"], case["keys_mxfp4"], case["blocks"], BLOCK,
                                     case["visible"], "mxfp4")
    out = candidate_scores_triton(case["q"], case["weights"], case["keys_mxfp4"], case["blocks"], BLOCK,
                                  case["visible"], "mxfp4")
    finite = ref.isfinite()
    assert torch.equal(finite, out.isfinite()), "candidate kernel: -inf pattern differs from the reference"
    err = (out[finite].float() - ref[finite].float()).abs().max().item()
    scale = ref[finite].float().abs().max().item()
    assert err <= 4 * 2 ** -8 * scale, f"candidate kernel: max error {err} at scale {scale}"
    dense, cand = dense_path(case), candidate_path(case)
    # share of the dense path's picks that the candidate path also picks (exact ties at the cut may differ)
    same = (dense.unsqueeze(-1) == cand.unsqueeze(-2)).any(-1).float().mean().item()
    return {"candidate_kernel_max_abs_error": err, "score_scale": scale, "topk_rows_agree": same}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="contexts 8K/128K, batches 1/64")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = run_metadata()
    result["check"] = check(gen)
    print("check:", result["check"])

    rows = []
    contexts = (8192, 131072) if args.quick else (8192, 131072, 524288)
    points = [(b, 1) for b in ((1, 64) if args.quick else (1, 8, 64))] + [(1, 4096)]
    for context in contexts:
        for batch, seq in points:
            case = make_case(batch, context, seq, gen)
            dense_s = time_eager(lambda: dense_path(case), iters=3 if seq > 1 else 10)
            cand_s = time_graph(lambda: candidate_path(case), calls=2 if seq > 1 else 10, replays=5 if seq > 1 else 20)
            row = {"context": context, "batch": batch, "seq": seq, "dense_mask_topk_s": dense_s,
                   "candidate_only_s": cand_s, "speedup": dense_s / cand_s}
            print(row)
            rows.append(row)
            del case
            torch.cuda.empty_cache()
    result["layer"] = rows

    topk_rows = []
    for n_rows, width in ((1, 16384), (64, 16384), (1, 1 << 20), (64, 1 << 20), (4096, 131072), (4096, 524288)):
        scores = torch.randn(n_rows, width, generator=gen, device="cuda").bfloat16()
        torch_s = time_graph(lambda: scores.topk(TOPK, dim=-1), calls=2, replays=5)
        ours_s = time_graph(lambda: top_k_stable(scores, TOPK), calls=2, replays=5)
        topk_rows.append({"rows": n_rows, "width": width, "torch_topk_s": torch_s, "top_k_stable_s": ours_s,
                          "speedup": torch_s / ours_s})
        print(topk_rows[-1])
        del scores
    result["topk"] = topk_rows

    print(f"\n{'ctx':>7} {'B':>3} {'S':>5} {'dense+mask+topk ms':>19} {'candidate ms':>13} {'x':>6}")
    for r in rows:
        print(f"{r['context']:>7} {r['batch']:>3} {r['seq']:>5} {r['dense_mask_topk_s'] * 1e3:19.3f} "
              f"{r['candidate_only_s'] * 1e3:13.3f} {r['speedup']:6.1f}")
    save_results(result, "indexer", args.out)


if __name__ == "__main__":
    main()
