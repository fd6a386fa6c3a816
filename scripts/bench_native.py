"""Benchmark of the native-weight ops (issue 9) at the release's shapes on one GPU, decode batches:

  fp8_block_linear   dsflash::fp8_block_linear (Triton, FP8 tiles dequantized in registers) against the bf16
                     projection (cuBLAS, `layers.block_diagonal_linear`) for wq_a, wq_b, wkv, wo_a (8 groups),
                     wo_b, the indexer's wq_b, the shared expert and Engram's wkv; plus a K-split sweep
  mxfp4_grouped_mm   the routed experts' grouped GEMM over MXFP4 (Triton) against torch._grouped_mm over
                     bf16 stacks, 384 experts, top-6 of random routing, w1 (and w3: same shape) and w2

    python scripts/bench_native.py            (writes benchmarks/results/native-<date>.json)
    python scripts/bench_native.py --tokens 1 8 64 256 1024 4096     (also where cuBLAS on a weight dequantized
                                              once overtakes the kernel: fp8_linear_triton.MAX_ROWS)

Correctness first (each point against the op's reference, worst error relative to sum |x| |w|), then
CUDA-graph replay times (median; launches excluded) and the achieved bandwidth: bytes of the weights the
call must read (the selected experts only) per second. A failing point is reported and the run goes on.
"""

from __future__ import annotations

import argparse

import torch

from dsflash_compile import formats
from dsflash_compile.benchmarking import copy_bandwidth, print_table, run_metadata, save_results, time_graph, timed
from dsflash_compile.custom_ops.fp8_linear import fp8_block_linear_reference
from dsflash_compile.custom_ops.fp8_linear_triton import fp8_block_linear_triton
from dsflash_compile.custom_ops.mxfp4_experts import mxfp4_grouped_mm_reference
from dsflash_compile.custom_ops.mxfp4_experts_triton import grouped_mm_triton
from dsflash_compile.layers import block_diagonal_linear

# name: (outputs, inputs per group, groups)
PROJECTIONS = {"wq_a": (1280, 5120, 1), "wq_b": (32768, 1280, 1), "wkv": (512, 5120, 1), "wo_a": (8192, 4096, 8),
               "wo_b": (5120, 8192, 1), "indexer.wq_b": (4096, 1280, 1), "shared.w1": (2304, 5120, 1),
               "shared.w2": (5120, 2304, 1), "engram.wkv": (25600, 6144, 1)}
EXPERTS, TOPK, DIM, INTER = 384, 6, 5120, 2304
EXPERT_PROJECTIONS = {"experts.w1": (INTER, DIM), "experts.w2": (DIM, INTER)}  # name: (outputs, inputs)
COLUMNS = [("op", "name", "s"), ("tokens", "tokens", "d"), ("bf16 us", "bf16_s", ".1f", 1e6),
           ("native us", "native_s", ".1f", 1e6), ("x", "speedup", ".2f"), ("native GB/s", "native_GBps", ".0f"),
           ("bf16 GB/s", "bf16_GBps", ".0f"), ("best split", "best_splits", "d"), ("err", "err", ".1e")]


def error(got, want, mag) -> float:
    return float(((got.float() - want.float()).abs() / mag.float().clamp_min(1e-30)).max())


def projection_case(n, k, groups, tokens, gen):
    """Activations, an FP8 weight, its scales, the weight dequantized, the reference output and sum |x| |w|."""
    x = torch.randn(tokens, groups * k, generator=gen, device="cuda").bfloat16()
    weight, scale = formats.quant_fp8_block(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5)
    want = fp8_block_linear_reference(x, weight, scale, groups)
    mag = fp8_block_linear_reference(x.abs(), weight.float().abs().to(torch.float8_e4m3fn), scale, groups)
    return x, weight, scale, formats.dequant_fp8_block(weight, scale), want, mag


def experts_case(n, k, tokens, gen, experts=EXPERTS, shared=False, mxfp4=True):
    """Rows sorted by expert for top-TOPK random routing over `experts`, the stacked MXFP4 experts and scales,
    offsets, the bf16 stack, the reference output, sum |x| |w| and the share of the stack's slices used.
    mxfp4=False: bf16 experts only (weight and scale None, torch._grouped_mm the reference). shared: the shared
    expert as the stacks' last slice, one more row per token, as moe.py runs bf16 weights after
    stack_experts(shared=True) (compile()'s default); native MoEs keep it apart (FP8)."""
    ids = torch.stack([torch.randperm(experts, generator=gen, device="cuda")[:TOPK] for _ in range(tokens)])
    if shared:
        ids = torch.cat([ids, torch.full_like(ids[:, :1], experts)], 1)
    slices = experts + shared
    counts = torch.bincount(ids.flatten(), minlength=slices)
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(ids.numel(), k, generator=gen, device="cuda").bfloat16()
    if mxfp4:
        encoded = [formats.quant_mxfp4(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5)
                   for _ in range(slices)]
        weight, scale = (torch.stack(t) for t in zip(*encoded))
        del encoded
        dense = torch.stack([formats.dequant_mxfp4(w, s) for w, s in zip(weight, scale)])
        want = mxfp4_grouped_mm_reference(x, weight, scale, offsets)
        mag = mxfp4_grouped_mm_reference(x.abs(), weight & 0x77, scale, offsets)
    else:
        weight = scale = None
        dense = (torch.randn(slices, n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
        want = torch._grouped_mm(x, dense.transpose(1, 2), offs=offsets)
        mag = torch._grouped_mm(x.abs(), dense.abs().transpose(1, 2), offs=offsets)
    return x, weight, scale, offsets, dense, want, mag, int((counts > 0).sum()) / slices


def bench_projection(name, n, k, groups, tokens, gen) -> dict:
    x, weight, scale, dense, want, mag = projection_case(n, k, groups, tokens, gen)
    row = {"name": name, "tokens": tokens}
    row["err"] = error(fp8_block_linear_triton(x, weight, scale, groups), want, mag)
    timed(row, "bf16_s", lambda: time_graph(lambda: block_diagonal_linear(x, dense, groups)))
    timed(row, "native_s", lambda: time_graph(lambda: fp8_block_linear_triton(x, weight, scale, groups)))
    sweep = {}
    for splits in (1, 2, 4, 8, 16, 32):
        timed(sweep, str(splits), lambda: time_graph(lambda: fp8_block_linear_triton(x, weight, scale, groups, splits)))
    row["splits_s"] = sweep
    measured = {s: t for s, t in sweep.items() if isinstance(t, float)}
    row["best_splits"] = int(min(measured, key=measured.get)) if measured else None
    finish(row, weight.numel() + scale.numel(), 2 * dense.numel())
    return row


def bench_experts(name, n, k, tokens, gen) -> dict:
    x, weight, scale, offsets, dense, want, mag, used = experts_case(n, k, tokens, gen)
    row = {"name": name, "tokens": tokens, "experts_used": round(used * EXPERTS)}
    row["err"] = error(grouped_mm_triton(x, weight, scale, offsets), want, mag)
    timed(row, "bf16_s", lambda: time_graph(lambda: torch._grouped_mm(x, dense.transpose(1, 2), offs=offsets)))
    timed(row, "native_s", lambda: time_graph(lambda: grouped_mm_triton(x, weight, scale, offsets)))
    finish(row, used * (weight.numel() + scale.numel()), used * 2 * dense.numel())
    return row


def finish(row: dict, native_bytes: float, bf16_bytes: float) -> None:
    row["native_bytes"], row["bf16_bytes"] = native_bytes, bf16_bytes
    if row.get("native_s"):
        row["native_GBps"] = native_bytes / row["native_s"] / 1e9
    if row.get("bf16_s"):
        row["bf16_GBps"] = bf16_bytes / row["bf16_s"] / 1e9
        if row.get("native_s"):
            row["speedup"] = row["bf16_s"] / row["native_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {**run_metadata(), "copy_bandwidth_Bps": copy_bandwidth(), "rows": []}
    for name, (n, k, groups) in PROJECTIONS.items():
        for tokens in args.tokens:
            result["rows"].append(bench_projection(name, n, k, groups, tokens, gen))
            print_table(result["rows"][-1:], COLUMNS)
    for name, (n, k) in EXPERT_PROJECTIONS.items():
        for tokens in args.tokens:
            result["rows"].append(bench_experts(name, n, k, tokens, gen))
            print_table(result["rows"][-1:], COLUMNS)
    print_table(result["rows"], COLUMNS)
    save_results(result, "native", args.out)


if __name__ == "__main__":
    main()
