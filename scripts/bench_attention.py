"""Per-layer attention benchmark on one GPU: the Triton op over NVFP4 / FP8 / bf16 compressed records
against the plain PyTorch reference (gather + softmax over bf16 caches: the day-zero path), with its
roofline: achieved FLOP rate against a bf16 matmul measured in the same run, and bytes moved against the
measured copy bandwidth.

    python scripts/bench_attention.py [--quick] [--no-sweep]   (writes benchmarks/results/attention-<date>.json)

Shapes are the release's (64 heads x 512, rope 64, window 128 in FP8 records, top-512 compressed rows of a
ratio-1 layer: one row per context token). Decode: one query per row, batch 1/8/64, contexts 4K/64K/512K
(--quick: 4K/64K). Prefill: one 4K-token chunk. Timing: CUDA-graph replays (10 calls per replay), median
of 20 replays; the reference is timed eagerly (it is the eager path). Correctness against the reference
comes first. Work per query token: 4 H D FLOP per valid key (Q K^T and P V, a multiply-add each), i.e.
84 MFLOP for 640 keys, against 215 KB (NVFP4) / 338 KB (FP8) of records: above the H200's bf16 ridge
(~790 TFLOP/s / ~4.2 TB/s ~ 190 FLOP/byte), so the op is compute-bound and TFLOP/s is its yardstick.
"""

from __future__ import annotations

import argparse

import torch
import triton

from dsflash_compile.benchmarking import copy_bandwidth, print_table, run_metadata, save_results, time_eager, time_graph
from dsflash_compile.custom_ops import records
from dsflash_compile.custom_ops.attention import attention_reference
from dsflash_compile.custom_ops.attention_triton import attention_triton
from dsflash_compile.rope import inverse_frequencies

H, D, R_DIMS, W, TOPK = 64, 512, 64, 128, 512
FORMATS = ("nvfp4", "fp8", "bf16")
COLUMNS = [("phase", "phase", "s"), ("ctx", "context", "d"), ("B", "batch", "d"), ("nvfp4 us", "nvfp4_s", ".1f", 1e6),
           ("fp8 us", "fp8_s", ".1f", 1e6), ("bf16 us", "bf16_s", ".1f", 1e6),
           ("ref us", "reference_bf16_s", ".1f", 1e6), ("nv/fp8", "nvfp4_over_fp8", ".3f"),
           ("nv TF/s", "nvfp4_tflops", ".1f"), ("nv MM%", "nvfp4_flop_fraction", ".1f", 100),
           ("fp8 MM%", "fp8_flop_fraction", ".1f", 100), ("nv BW%", "nvfp4_bw_fraction", ".1f", 100),
           ("fp8 BW%", "fp8_bw_fraction", ".1f", 100), ("nv x ref", "speedup_nvfp4_vs_reference", ".1f")]


def record_pool(fmt: str, rows: int, gen: torch.Generator) -> torch.Tensor:
    """`rows` encoded rows of K=V-like values (on the release's grids after encoding)."""
    values = torch.randn(rows, D, generator=gen, device="cuda").bfloat16()
    return values if fmt == "bf16" else records.encode_reference(values, fmt)


def make_case(batch: int, context: int, seq: int, fmt: str, gen: torch.Generator) -> dict:
    """Caches and inputs of one layer step: `seq` new tokens per row after `context - seq` cached ones."""
    pool = record_pool(fmt, 4096, gen)
    reps = triton.cdiv(context, pool.shape[0])
    compressed = pool.repeat(reps, 1)[:context].unsqueeze(0).expand(batch, -1, -1).contiguous()
    ring = record_pool("fp8", W, gen).unsqueeze(0).repeat(batch, 1, 1)
    chunk = torch.randn(batch, seq, D, generator=gen, device="cuda").bfloat16()
    cached = context - seq
    pos = cached + torch.arange(seq, device="cuda")  # positions of the new tokens
    key_pos = (pos - W + 1).clamp_min(0).unsqueeze(-1) + torch.arange(W, device="cuda")
    widx = torch.where(key_pos < cached, key_pos % W, W + key_pos - cached)
    widx = torch.where(key_pos <= pos.unsqueeze(-1), widx, -1).int().unsqueeze(0).expand(batch, -1, -1).contiguous()
    # top-512 distinct visible rows per query, ascending (what the indexer hands over)
    scores = torch.rand(batch, seq, context, generator=gen, device="cuda") if seq * context <= 2 ** 26 else None
    if scores is not None:
        scores = scores.masked_fill(torch.arange(context, device="cuda") > pos.view(1, -1, 1), -1)
        cidx = scores.topk(min(TOPK, context), dim=-1).indices.sort(-1).values.int()
    else:  # large prefill: random rows below each query's position (duplicates allowed, order ascending)
        cidx = (torch.rand(batch, seq, TOPK, generator=gen, device="cuda") * (pos.view(1, -1, 1) + 1)).long()
        cidx = cidx.sort(-1).values.int()
    return dict(q=torch.randn(batch, seq, H, D, generator=gen, device="cuda").bfloat16(), ring=ring,
                chunk_kv=chunk, widx=widx, compressed=compressed, cidx=cidx,
                sink=torch.randn(H, generator=gen, device="cuda"), positions=pos.unsqueeze(0).expand(batch, -1).contiguous(),
                inv_freq=inverse_frequencies(R_DIMS, 160000.0).cuda(), fmt=fmt)


def run_triton(case, out, **cfg):
    attention_triton(out, case["q"], case["ring"], case["chunk_kv"], case["widx"], case["compressed"], case["cidx"],
                     case["sink"], case["positions"], case["inv_freq"], D ** -0.5, "fp8", case["fmt"], **cfg)


def run_reference(case, out):
    attention_reference(out, case["q"], case["ring"], case["chunk_kv"], case["widx"], case["compressed"],
                        case["cidx"], case["sink"], case["positions"], case["inv_freq"], D ** -0.5, "fp8", case["fmt"])


def bytes_moved(case) -> int:
    """HBM bytes a perfect kernel moves: q, out, index lists, and each listed key row once per token."""
    q, widx, cidx = case["q"], case["widx"], case["cidx"]
    ring_row = case["ring"].shape[-1] * case["ring"].element_size()
    comp_row = case["compressed"].shape[-1] * case["compressed"].element_size()
    in_ring = ((widx >= 0) & (widx < W)).sum().item()
    in_chunk = (widx >= W).sum().item()
    return (2 * q.numel() * 2 + (widx.numel() + cidx.numel()) * 4 + in_ring * ring_row + in_chunk * D * 2
            + (cidx >= 0).sum().item() * comp_row)


def flops(case) -> int:
    """Tensor-core work of the op: 4 H D per valid (query, key) pair."""
    valid = (case["widx"] >= 0).sum().item() + (case["cidx"] >= 0).sum().item()
    return 4 * H * D * valid


def matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an n^3 bf16 matmul on random data (median of 10 after 3 warm-ups): the compute ceiling."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / time_graph(lambda: a @ b, calls=1, replays=10)


def check(gen) -> dict:
    """Max |op - reference| per format: a 3-token chunk (unsplit and split, 32-key blocks) and a batch of 40
    decode rows (split, 64-key blocks)."""
    errors = {}
    for fmt in FORMATS:
        for batch, seq, splits in ((2, 3, 1), (2, 3, None), (40, 1, None)):
            case = make_case(batch, 3000, seq, fmt, gen)
            ref, out = torch.empty_like(case["q"]), torch.full_like(case["q"], float("nan"))
            run_reference(case, ref)
            run_triton(case, out, num_splits=splits)
            err = (out.float() - ref.float()).abs().max().item()
            errors[f"{fmt} batch={batch} seq={seq} splits={splits}"] = err
            assert err <= 0.05 * ref.float().abs().max().item(), (fmt, batch, splits, err)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="contexts 4K/64K only")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--no-sweep", action="store_true", help="skip the block_n sweep")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = run_metadata()
    result["max_abs_error_vs_reference"] = check(gen)
    copy_bw = copy_bandwidth()
    result["copy_bandwidth_Bps"] = copy_bw

    flop_rate = matmul_rate()
    result["matmul_bf16_flops_per_s"] = flop_rate
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s, bf16 matmul {flop_rate / 1e12:.0f} TFLOP/s")

    sweep = []  # keys per block x decode batch, 64K context (the defaults pick 32 below 32 tokens, else 64)
    for block_n in () if args.no_sweep else (32, 64):
        for batch in (1, 8, 64):
            for fmt in ("nvfp4", "fp8"):
                case = make_case(batch, 65536, 1, fmt, gen)
                out = torch.empty_like(case["q"])
                t = time_graph(lambda: run_triton(case, out, block_n=block_n))
                sweep.append(dict(block_n=block_n, batch=batch, fmt=fmt, seconds=t))
                print(f"sweep block_n={block_n} batch={batch} {fmt}: {t * 1e6:.1f} us")
                del case, out
    result["sweep"] = sweep

    rows = []
    contexts = (4096, 65536) if args.quick else (4096, 65536, 524288)
    batches = (1, 8, 64)
    for context in contexts:
        for batch in batches:
            point = {"phase": "decode", "context": context, "batch": batch}
            for fmt in FORMATS:
                case = make_case(batch, context, 1, fmt, gen)
                out = torch.empty_like(case["q"])
                t = time_graph(lambda: run_triton(case, out))
                point[f"{fmt}_s"] = t
                point[f"{fmt}_flop_fraction"] = flops(case) / t / flop_rate
                point[f"{fmt}_bytes"] = bytes_moved(case)
                point[f"{fmt}_bw_fraction"] = bytes_moved(case) / t / copy_bw
                point["flop"] = flops(case)
                if fmt == "bf16":
                    point["reference_bf16_s"] = time_eager(lambda: run_reference(case, out))
                del case, out
                torch.cuda.empty_cache()
            point["nvfp4_tflops"] = point["flop"] / point["nvfp4_s"] / 1e12
            point["nvfp4_over_fp8"] = point["nvfp4_s"] / point["fp8_s"]
            for fmt in FORMATS:
                point[f"speedup_{fmt}_vs_reference"] = point["reference_bf16_s"] / point[f"{fmt}_s"]
            rows.append(point)
            print(point)
            result["rows"] = rows
            save_results(result, "attention", args.out)  # kept if a later (larger) point runs out of time
    prefill = {"phase": "prefill", "context": 4096, "batch": 1, "seq": 4096}
    for fmt in FORMATS:
        case = make_case(1, 4096, 4096, fmt, gen)
        out = torch.empty_like(case["q"])
        prefill[f"{fmt}_s"] = time_graph(lambda: run_triton(case, out), calls=2, replays=5)
        prefill[f"{fmt}_flop_fraction"] = flops(case) / prefill[f"{fmt}_s"] / flop_rate
        prefill["flop"] = flops(case)
        if fmt == "bf16":
            prefill["reference_bf16_s"] = time_eager(lambda: run_reference(case, out), iters=2)
        del case, out
    prefill["nvfp4_tflops"] = prefill["flop"] / prefill["nvfp4_s"] / 1e12
    prefill["nvfp4_over_fp8"] = prefill["nvfp4_s"] / prefill["fp8_s"]
    for fmt in FORMATS:
        prefill[f"speedup_{fmt}_vs_reference"] = prefill["reference_bf16_s"] / prefill[f"{fmt}_s"]
    rows.append(prefill)
    print(prefill)
    result["rows"] = rows

    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s, bf16 matmul {flop_rate / 1e12:.0f} TFLOP/s "
          "(MM% = achieved FLOP rate / matmul rate, BW% = bytes moved / copy bandwidth)")
    print_table(rows, COLUMNS)
    save_results(result, "attention", args.out)


if __name__ == "__main__":
    main()
