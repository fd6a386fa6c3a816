"""Per-layer benchmark of the lightning indexer on one GPU (MODEL.md 4.2, BENCHMARKS.md's indexer target):

  day-zero   a level-2 index source (layers 24/28/32/36) as plain PyTorch: dense scores over every
             visible row (reference op, bf16 keys) + mask to the candidate rows + torch.topk
  candidate  the same layer with the dsflash ops on CUDA: candidate_scores over the 2048 x 8 candidate
             rows only (Triton, MXFP4 key records) + candidate_topk (radix select, remap to row ids)
  source     the candidate source (layer 20) with the dsflash ops: dense indexer_scores (Triton, MXFP4
             records in place) + candidate_blocks + topk_indices (for reference; no target)
  top-k      topk_indices vs torch.topk (k = 512) on each shape's dense [rows, context] scores and on the
             candidate path's [rows, 16384]; the path the op picks (topk_triton.topk_path: filter or
             row-wise for many rows, segmented filter for 8-64 wide rows, radix split for fewer) and, for
             comparison, the radix path forced (and, with topk_triton.SEGMENTED_ON off, the segmented
             filter path where it would be chosen)
  prefill    candidate_scores of the prefill chunk on the path the op picks (union of neighbours' blocks,
             tensor-core M = UNION_TOKENS x 32 heads) and on the per-token path forced, with the share of the
             union that one token uses (1 = identical lists)

    python scripts/bench_indexer.py [--quick]     (writes benchmarks/results/indexer-<date>.json)

Correctness first: each Triton op against its reference (scores within bf16 rounding-order differences,
block ids and top-k picks exactly), printed PASS/FAIL with the worst errors; the timings run either way
and the script exits 1 if a check failed. Shapes are the release's: 32 index heads x 128, top-512,
candidates 2048 blocks of 8, a ratio-1 layer (one key row per context token). Decode: batch 1/8/64,
contexts 8K/128K/512K; prefill: one 4K-token chunk (queries at the end of the context, causal). The
day-zero path is timed eagerly (it is the eager path), the ops in CUDA graphs.

Candidate lists: decode rows get independent random blocks. A prefill chunk's neighbouring tokens get
what layer 20 publishes for close queries: each token's top-2048 of a block score shared by the chunk
plus a per-token part (--spread, relative to the shared part; most blocks shared, not all), so the
union path sees realistic overlap; `--spread 0` is not used (identical lists would flatter it), and
`--random-prefill` gives every token independent blocks (the union path's worst case).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dsflash_compile.benchmarking import run_metadata, save_results, time_eager, time_graph
from dsflash_compile.custom_ops import records
from dsflash_compile.custom_ops import indexer_triton, topk_triton
from dsflash_compile.custom_ops.indexer import (candidate_blocks_reference, candidate_rows,
                                                candidate_scores_reference, candidate_topk_reference,
                                                indexer_scores_reference)
from dsflash_compile.custom_ops.topk import topk_indices_reference

HEADS, DIM, TOPK, BLOCKS, BLOCK = 32, 128, 512, 2048, 8
ops = torch.ops.dsflash


def make_case(batch: int, context: int, seq: int, gen: torch.Generator, spread: float | None = None) -> dict:
    """One layer step: `seq` query tokens per row at the end of a `context`-row cache, keys on the MXFP4
    grid (the records, and the same keys as bf16 rows for the day-zero path), candidate blocks: random per
    token (spread None) or neighbours' overlapping lists (top blocks of shared + spread x per-token
    scores; see the module docstring)."""
    q = torch.randn(batch, seq, HEADS, DIM, generator=gen, device="cuda").bfloat16()
    weights = (torch.randn(batch, seq, HEADS, generator=gen, device="cuda") * (HEADS * DIM) ** -0.5).bfloat16()
    keys_mxfp4 = torch.stack([records.encode_reference(torch.randn(context, DIM, generator=gen, device="cuda"), "mxfp4")
                              for _ in range(batch)])  # one sequence at a time: fp32 temporaries of 17 GB otherwise
    keys_bf16 = records.decode_reference(keys_mxfp4, "mxfp4", DIM)
    visible = torch.full((batch, seq), context, device="cuda") - torch.arange(seq, device="cuda").flip(0)
    n_blocks = -(-context // BLOCK)
    if spread is None:
        block_score = torch.rand(batch, seq, n_blocks, generator=gen, device="cuda")
    else:
        block_score = torch.randn(batch, 1, n_blocks, generator=gen, device="cuda") + spread * torch.randn(
            batch, seq, n_blocks, generator=gen, device="cuda")
    blocks = block_score.topk(min(BLOCKS, n_blocks), -1).indices
    del block_score
    return dict(q=q, weights=weights, keys_bf16=keys_bf16, keys_mxfp4=keys_mxfp4, visible=visible,
                blocks=blocks.sort(-1).values.to(torch.int32), context=context)


def day_zero_path(case, query_chunk: int = 128) -> torch.Tensor:
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


def union_share(case) -> float:
    """Mean over groups of UNION_TOKENS neighbouring tokens: blocks in one token's list / blocks in the
    group's union."""
    tq = indexer_triton.UNION_TOKENS
    blocks = case["blocks"].long()
    batch, seq, nb = blocks.shape
    groups = blocks[:, :seq // tq * tq].reshape(batch, seq // tq, tq * nb)
    n_blocks = -(-case["context"] // BLOCK)
    seen = torch.zeros(*groups.shape[:-1], n_blocks + 1, device=blocks.device)
    seen.scatter_(-1, torch.where(groups >= 0, groups, n_blocks), 1.0)
    return ((blocks >= 0).sum(-1).float().mean() / seen[..., :n_blocks].sum(-1).mean()).item()


def candidate_path(case) -> torch.Tensor:
    scores = ops.candidate_scores(case["q"], case["weights"], case["keys_mxfp4"], case["blocks"], BLOCK,
                                  case["visible"], "mxfp4")
    return ops.candidate_topk(scores, case["blocks"], BLOCK, min(TOPK, case["context"]))


def source_path(case) -> torch.Tensor:
    scores = ops.indexer_scores(case["q"], case["weights"], case["keys_mxfp4"], case["visible"], case["context"],
                                "mxfp4")
    blocks = ops.candidate_blocks(scores, case["visible"], BLOCKS, BLOCK)
    return ops.topk_indices(scores, min(TOPK, case["context"]), case["visible"]), blocks


# ------------------------------------------------------------------------------------------ correctness


def score_check(name, out, ref, bound_ulps) -> dict:
    """Same -inf pattern, worst |out - ref| within bound_ulps x 2^-8 of the largest |score|."""
    finite = ref.isfinite()
    err = (out[finite].float() - ref[finite].float()).abs().max().item()
    scale = ref[finite].float().abs().max().item()
    ok = bool(torch.equal(finite, out.isfinite())) and err <= bound_ulps * 2 ** -8 * scale
    print(f"  {'PASS' if ok else 'FAIL'}  {name}: max abs error {err:.4g} at score scale {scale:.4g} "
          f"(bound {bound_ulps} x 2^-8 x scale), same -inf pattern: {bool(torch.equal(finite, out.isfinite()))}")
    return {"name": name, "pass": ok, "max_abs_error": err, "score_scale": scale}


def exact_check(name, out, ref) -> dict:
    bad = (out != ref).flatten(0, -2).any(-1).sum().item()
    print(f"  {'PASS' if bad == 0 else 'FAIL'}  {name}: {bad} of {out.shape[:-1].numel()} rows differ")
    return {"name": name, "pass": bad == 0, "rows_differ": bad}


def guarded(name: str, run) -> dict:
    """One check or measurement; an exception is reported as a FAIL and the run goes on (one GPU call
    must show everything)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001  (reported, counted as a failure)
        print(f"  FAIL  {name}: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        return {"name": name, "pass": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def layer_agreement(case, shape) -> dict:
    """The level-2 layer end to end: the same rows as day-zero except at exact or near ties (bf16 scores
    rounded in another order; torch.topk breaks ties its own way): a wrong remap or mask agrees far less."""
    same = (day_zero_path(case).unsqueeze(-1) == candidate_path(case).unsqueeze(-2)).any(-1).float().mean().item()
    print(f"  {'PASS' if same > 0.95 else 'FAIL'}  candidate path vs day-zero path {shape}: {same:.4%} of picked rows "
          f"agree (ties aside)")
    return {"name": f"layer picks agree {shape}", "pass": same > 0.95, "share": same}


def checks(gen) -> list[dict]:
    print("correctness (Triton op vs reference):", flush=True)
    results = []
    # decode at the end of the context; a prefill chunk whose queries see 0 .. all rows (skipped key tiles)
    # decode-like (per-token path); prefill chunks (union path): random lists with ramped visibility,
    # neighbours' overlapping lists
    for batch, seq, context, ramp, spread in ((2, 3, 40000, False, None), (1, 64, 20000, True, None),
                                              (2, 37, 30000, False, 0.3)):
        case = make_case(batch, context, seq, gen, spread)
        if ramp:
            case["visible"] = torch.linspace(0, context, seq, device="cuda").long().view(1, seq)
        q, w, vis, blocks, keys = case["q"], case["weights"], case["visible"], case["blocks"], case["keys_mxfp4"]
        shape = f"B{batch} S{seq} ctx{context}" + ("" if spread is None else " overlapping")
        dense_ref = indexer_scores_reference(q, w, case["keys_bf16"], vis, context)
        cand_ref = candidate_scores_reference(q, w, keys, blocks, BLOCK, vis, "mxfp4")
        results += [
            guarded(f"indexer_scores {shape}", lambda: score_check(
                f"indexer_scores mxfp4 {shape}", ops.indexer_scores(q, w, keys, vis, context, "mxfp4"), dense_ref, 6)),
            guarded(f"candidate_blocks {shape}", lambda: exact_check(
                f"candidate_blocks {shape}", ops.candidate_blocks(dense_ref, vis, BLOCKS, BLOCK),
                candidate_blocks_reference(dense_ref, vis, BLOCKS, BLOCK))),
            guarded(f"topk_indices {shape}", lambda: exact_check(
                f"topk_indices {shape}", ops.topk_indices(dense_ref, TOPK, vis), topk_indices_reference(dense_ref, TOPK, vis))),
            guarded(f"candidate_scores {shape}", lambda: score_check(
                f"candidate_scores mxfp4 {shape}", ops.candidate_scores(q, w, keys, blocks, BLOCK, vis, "mxfp4"),
                cand_ref, 4)),
            guarded(f"candidate_topk {shape}", lambda: exact_check(
                f"candidate_topk {shape}", ops.candidate_topk(cand_ref, blocks, BLOCK, TOPK),
                candidate_topk_reference(cand_ref, blocks, BLOCK, TOPK))),
        ]
        if not ramp:  # (with queries that see nothing, both paths pick arbitrary -1 rows)
            results.append(guarded(f"layer picks agree {shape}", lambda: layer_agreement(case, shape)))
    # the op's paths at 132 SMs: radix, filter, row-wise (4 chunks), segmented
    for rows, width in ((1, 1 << 20), (4096, 16384), (200, 16384), (64, 1 << 19)):
        scores = torch.randn(1, rows, width, generator=gen, device="cuda").bfloat16()  # bf16: many exact ties
        vis = torch.full((1, rows), width, device="cuda")
        name = f"topk_indices {rows}x{width}"
        ref = topk_indices_reference(scores, TOPK, vis)
        results.append(guarded(name, lambda: exact_check(name, ops.topk_indices(scores, TOPK, vis), ref)))
        segments = topk_triton.filter_segments(rows, width, TOPK, scores.device, on=True)
        if segments and topk_triton.topk_path(rows, width, TOPK, scores.device) != "segmented":  # (SEGMENTED_ON off)
            name = f"topk segmented x{segments} {rows}x{width}"
            results.append(guarded(name, lambda: exact_check(name, topk_triton.finish(
                topk_triton.select_filtered(scores.view(rows, width), TOPK, segments=segments), topk_triton.VISIBLE,
                visible=vis.view(rows)).view(1, rows, TOPK), ref)))
    return results


# ------------------------------------------------------------------------------------------------ timing


def time_topk(rows: int, width: int, gen) -> dict:
    scores = torch.randn(1, rows, width, generator=gen, device="cuda").bfloat16()
    vis = torch.full((1, rows), width, device="cuda")
    calls, replays = (2, 5) if rows * width > 1 << 28 else (10, 20)
    torch_s = time_graph(lambda: scores.topk(TOPK, dim=-1), calls=calls, replays=replays)
    ours_s = time_graph(lambda: ops.topk_indices(scores, TOPK, vis), calls=calls, replays=replays)
    path = topk_triton.topk_path(rows, width, TOPK, scores.device)
    row = {"rows": rows, "width": width, "torch_topk_s": torch_s, "topk_indices_s": ours_s, "speedup": torch_s / ours_s,
           "path": path}
    if path != "radix":  # the radix path on the same shape, for comparison
        row["radix_s"] = time_graph(lambda: topk_triton.topk_indices_triton(scores, TOPK, vis, block=topk_triton.BLOCK),
                                    calls=calls, replays=replays)
    segments = topk_triton.filter_segments(rows, width, TOPK, scores.device, on=True)
    if segments and path != "segmented":  # (SEGMENTED_ON off) the segmented path where it would be chosen
        flat = scores.view(rows, width)
        row["segments"] = topk_triton.segment_plan(width, segments)[0]
        row["segmented_s"] = time_graph(lambda: topk_triton.select_filtered(flat, TOPK, segments=segments),
                                        calls=calls, replays=replays)
    print(f"  top-k {rows:>4} x {width:>7}: torch.topk {torch_s * 1e3:8.3f} ms, topk_indices {ours_s * 1e3:8.3f} ms "
          f"({row['speedup']:5.1f}x, {path})" + "".join(
              f", {name} forced {row[key] * 1e3:8.3f} ms ({torch_s / row[key]:5.1f}x)"
              for name, key in (("radix", "radix_s"), ("segmented", "segmented_s")) if key in row), flush=True)
    return row


def time_prefill_scores(case) -> dict:
    """candidate_scores alone on the prefill chunk: the path the op picks vs the per-token path forced."""
    args = (case["q"], case["weights"], case["keys_mxfp4"], case["blocks"], BLOCK, case["visible"], "mxfp4")
    picked = "union" if indexer_triton.union_fits(case["q"].shape[1], BLOCK) else "per-token"
    op_s = time_graph(lambda: ops.candidate_scores(*args), calls=2, replays=5)
    per_token_s = time_graph(lambda: indexer_triton.candidate_scores_triton(*args, union=False), calls=2, replays=5)
    share = union_share(case)
    print(f"    candidate_scores: op ({picked}) {op_s * 1e3:8.3f} ms, per-token path {per_token_s * 1e3:8.3f} ms "
          f"({per_token_s / op_s:5.1f}x); one token's list = {share:.0%} of its group's union", flush=True)
    return {"path": picked, "candidate_scores_s": op_s, "per_token_scores_s": per_token_s, "union_share": share}


def time_layer(batch: int, context: int, seq: int, gen, spread: float | None = None) -> dict:
    prefill = seq > 1
    case = make_case(batch, context, seq, gen, spread if seq >= 4 else None)
    day_zero_s = time_eager(lambda: day_zero_path(case), iters=2 if prefill else 10)
    cand_s = time_graph(lambda: candidate_path(case), calls=2 if prefill else 10, replays=5 if prefill else 20)
    source_s = time_graph(lambda: source_path(case), calls=1 if prefill else 10, replays=3 if prefill else 20)
    row = {"context": context, "batch": batch, "seq": seq, "day_zero_s": day_zero_s, "candidate_s": cand_s,
           "speedup": day_zero_s / cand_s, "source_layer_s": source_s}
    print(f"ctx {context:>7} B {batch:>2} S {seq:>4}: day-zero {day_zero_s * 1e3:9.3f} ms, candidate "
          f"{cand_s * 1e3:8.3f} ms ({row['speedup']:6.1f}x), source layer {source_s * 1e3:8.3f} ms", flush=True)
    if seq >= 4:
        row.update(time_prefill_scores(case))
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="contexts 8K/128K, batches 1/8/64")
    parser.add_argument("--spread", type=float, default=0.3,
                        help="prefill lists: per-token part of the block score relative to the shared part")
    parser.add_argument("--random-prefill", action="store_true", help="prefill lists independent per token")
    parser.add_argument("--no-decode", action="store_true", help="time the prefill chunk only")
    parser.add_argument("--contexts", type=int, nargs="+", help="contexts to time (default 8K 128K 512K)")
    parser.add_argument("--prefill", type=int, default=4096, help="query tokens of the prefill chunk")
    parser.add_argument("--budget", type=float, default=260, help="seconds after which timing points are skipped")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    started = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = run_metadata()
    result["checks"] = checks(gen)
    failed = [c["name"] for c in result["checks"] if not c["pass"]]

    rows, topk_rows, topk_done = [], [], set()
    contexts = args.contexts or ((8192, 131072) if args.quick else (8192, 131072, 524288))
    points = [] if args.no_decode else [(b, 1) for b in (1, 8, 64)]
    points.append((1, args.prefill))
    spread = None if args.random_prefill else args.spread
    for context in contexts:
        for batch, seq in points:
            if time.time() - started > args.budget:
                print(f"ctx {context} B {batch} S {seq}: skipped (past the {args.budget} s budget)")
                rows.append({"context": context, "batch": batch, "seq": seq, "skipped": "time budget"})
                continue
            rows.append(guarded(f"layer ctx {context} B {batch} S {seq}", lambda: time_layer(batch, context, seq, gen, spread)))
            torch.cuda.empty_cache()
            for shape in ((batch * seq, context), (batch * seq, BLOCKS * BLOCK)):
                if shape not in topk_done and shape[1] >= TOPK and time.time() - started <= args.budget:
                    topk_done.add(shape)
                    topk_rows.append(guarded(f"top-k {shape}", lambda: time_topk(*shape, gen)))
                    torch.cuda.empty_cache()
    result["layer"], result["topk"] = rows, topk_rows

    targets = {8192: 1.0, 131072: 5.0, 524288: 20.0}
    print(f"\nper layer: candidate-only (dsflash ops) vs day-zero dense+mask+torch.topk (target x at 8K/128K/512K: "
          f"1 / 5 / 20)\n{'ctx':>7} {'B':>3} {'S':>5} {'day-zero ms':>12} {'candidate ms':>13} {'x':>7} {'target':>7} "
          f"{'source layer ms':>16}")
    for r in rows:
        if "speedup" not in r:
            print(f"  {r.get('name', r)}: {r.get('error', r.get('skipped'))}")
            continue
        met = "met" if r["speedup"] >= targets[r["context"]] else "MISSED"
        print(f"{r['context']:>7} {r['batch']:>3} {r['seq']:>5} {r['day_zero_s'] * 1e3:12.3f} {r['candidate_s'] * 1e3:13.3f} "
              f"{r['speedup']:7.1f} {met:>7} {r['source_layer_s'] * 1e3:16.3f}")
    print(f"\ntop-k (k = {TOPK}): topk_indices (radix select) vs torch.topk\n{'rows':>5} {'width':>8} {'torch ms':>9} "
          f"{'ours ms':>8} {'x':>6}")
    for r in topk_rows:
        if "speedup" not in r:
            print(f"  {r['name']}: {r['error']}")
            continue
        print(f"{r['rows']:>5} {r['width']:>8} {r['torch_topk_s'] * 1e3:9.3f} {r['topk_indices_s'] * 1e3:8.3f} "
              f"{r['speedup']:6.1f}")
    failed += [r["name"] for r in rows + topk_rows if "error" in r]
    result["prefill_tokens"] = args.prefill
    result["prefill_lists"] = "random" if args.random_prefill else f"overlapping, spread {args.spread}"
    result["wall_s"] = time.time() - started
    save_results(result, "indexer", args.out)
    print(f"checks: {'ALL PASS' if not failed else 'FAILED: ' + ', '.join(failed)}; {result['wall_s']:.0f} s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
