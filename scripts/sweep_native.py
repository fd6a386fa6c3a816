"""Sweep of the native-weight kernels' variants (issue 9) against bf16 at decode, side by side in one run:

  projections   bf16 cuBLAS (`layers.block_diagonal_linear`), the 11-30 conversion (ptx=False: Triton code,
                ~8 instructions per value, in the new loop) and the PTX conversion (2.5 per value) over a small
                grid of launches (BLOCK_N, BLOCK_K, programs per SM that the K splits aim at, pipeline stages)
  experts       384 MXFP4 experts (--experts), top-6: torch._grouped_mm and dsflash::grouped_mm over bf16 stacks, the
                Triton conversion and the PTX table lookup over a grid of (BLOCK_N, BLOCK_K, warps, stages) at
                the row tile the launch picks (BLOCK_M column: mxfp4_experts_triton.block_m_for) and at row tiles
                16 / 32 / 64

    python scripts/sweep_native.py        (1, 8 and 64 tokens; writes benchmarks/results/native-sweep-<date>.json)
    python scripts/sweep_native.py --tokens 1 --only wq_a experts.w1
    python scripts/sweep_native.py --tokens 8 64 --only experts.w1 experts.w2 --experts 8

Every variant is checked against the op's reference first (worst error relative to sum |x| |w| <= 2^-7, as the
tests); then CUDA-graph times and the achieved bandwidth in bytes of the weights each call must read. The best
agreeing variant of each (op, tokens) is marked; defaults are in custom_ops/fp8_linear_triton.py and
custom_ops/mxfp4_experts_triton.py.
"""

from __future__ import annotations

import argparse

import torch

from bench_native import EXPERT_PROJECTIONS, EXPERTS, PROJECTIONS, error, experts_case, projection_case
from dsflash_compile.benchmarking import copy_bandwidth, print_table, run_metadata, save_results, time_graph, timed
from dsflash_compile.custom_ops.fp8_linear_triton import fp8_block_linear_triton
from dsflash_compile.custom_ops.mxfp4_experts_triton import block_m_for, grouped_mm_triton
from dsflash_compile.layers import block_diagonal_linear

# fp8_block_linear_triton keywords; the first two: the default launch with the 11-30 conversion (Triton code) and
# with the PTX one (both with the scale prefetch and the one-kernel split sum); the grid with PTX (on CUDA the
# default up to fp8_linear_triton.PTX_MAX_ROWS rows since the 11-30 b run)
FP8_VARIANTS = [dict(ptx=False), dict(ptx=True)] + [
    dict(block_n=bn, block_k=bk, programs_per_sm=pps, num_stages=stages, ptx=True)
    for bn, bk, pps, stages in [(32, 128, 2, 3), (128, 128, 2, 3), (64, 256, 2, 3), (64, 128, 4, 3),
                                (128, 128, 4, 3), (64, 128, 2, 4)]]
# grouped_mm_triton keywords (MXFP4), the first two likewise
MXFP4_VARIANTS = [dict(ptx=False), dict(ptx=True)] + [
    dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, ptx=True)
    for bn, bk, warps, stages in [(16, 128, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (64, 256, 8, 3),
                                  (32, 128, 4, 4), (16, 256, 4, 4)]] + [
    # each row tile fixed, against the one block_m_for picks by rows per expert (above)
    dict(block_m=bm, ptx=True) for bm in (16, 32, 64)]
COLUMNS = [("op", "name", "s"), ("tokens", "tokens", "d"), ("variant", "variant", "s"), ("BLOCK_M", "block_m", "d"),
           ("us", "s", ".1f", 1e6), ("GB/s", "GBps", ".0f"), ("x bf16", "vs_bf16", ".2f"), ("err", "err", ".1e"),
           ("best", "best", "")]


def label(kwargs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in kwargs.items()) or "default"


def measure(rows, base, call, want, mag, nbytes, bf16_s=None, check=True) -> None:
    """One variant: agreement with the reference, then its graph time and bandwidth, appended to rows."""
    row = dict(base)
    if check:
        timed(row, "err", lambda: error(call(), want, mag))
        if row["err"] is None or row["err"] > 2 ** -7:
            rows.append(row)
            return
    timed(row, "s", lambda: time_graph(call))
    if row["s"]:
        row["GBps"] = nbytes / row["s"] / 1e9
        row["vs_bf16"] = bf16_s / row["s"] if bf16_s else None if check else 1.0  # 1.0: the baseline itself
    rows.append(row)


def sweep_projection(name, n, k, groups, tokens, gen) -> list[dict]:
    x, weight, scale, dense, want, mag = projection_case(n, k, groups, tokens, gen)
    base = {"name": name, "tokens": tokens}
    rows = []
    measure(rows, dict(base, variant="bf16 cuBLAS"), lambda: block_diagonal_linear(x, dense, groups), want, mag,
            2 * dense.numel(), check=False)
    for kwargs in FP8_VARIANTS:
        measure(rows, dict(base, variant=label(kwargs), kwargs=kwargs),
                lambda: fp8_block_linear_triton(x, weight, scale, groups, **kwargs), want, mag,
                weight.numel() + scale.numel(), rows[0].get("s"))
    return rows


def sweep_experts(name, n, k, tokens, gen, experts) -> list[dict]:
    x, weight, scale, offsets, dense, want, mag, used = experts_case(n, k, tokens, gen, experts)
    base = {"name": name, "tokens": tokens, "experts": experts}
    rows = []
    measure(rows, dict(base, variant="bf16 torch._grouped_mm"),
            lambda: torch._grouped_mm(x, dense.transpose(1, 2), offs=offsets), want, mag, used * 2 * dense.numel(),
            check=False)
    measure(rows, dict(base, variant="bf16 dsflash::grouped_mm"), lambda: grouped_mm_triton(x, dense, None, offsets),
            want, mag, used * 2 * dense.numel(), rows[0].get("s"))
    for kwargs in MXFP4_VARIANTS:
        block_m = kwargs.get("block_m") or block_m_for(x.shape[0], weight.shape[0])
        measure(rows, dict(base, variant=label(kwargs), kwargs=kwargs, block_m=block_m),
                lambda: grouped_mm_triton(x, weight, scale, offsets, **kwargs), want, mag,
                used * (weight.numel() + scale.numel()), rows[0].get("s"))
    return rows


def mark_best(rows: list[dict]) -> None:
    candidates = [r for r in rows if "kwargs" in r and r.get("s")]
    if candidates:
        min(candidates, key=lambda r: r["s"])["best"] = "*"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--only", nargs="+", help="ops by name (wq_a ... engram.wkv, experts.w1, experts.w2)")
    parser.add_argument("--experts", type=int, default=EXPERTS,
                        help=f"routed experts of the experts cases (default {EXPERTS}, the release; 8: flash-40l-e8)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {**run_metadata(), "copy_bandwidth_Bps": copy_bandwidth(), "rows": []}
    jobs = [(name, lambda t, s=shape, nm=name: sweep_projection(nm, *s, t, gen)) for name, shape in PROJECTIONS.items()]
    jobs += [(name, lambda t, s=shape, nm=name: sweep_experts(nm, *s, t, gen, args.experts))
             for name, shape in EXPERT_PROJECTIONS.items()]
    for name, job in jobs:
        if args.only and name not in args.only:
            continue
        for tokens in args.tokens:
            rows = job(tokens)
            mark_best(rows)
            print_table(rows, COLUMNS)
            result["rows"] += rows
        torch.cuda.empty_cache()
    save_results(result, "native-sweep", args.out)


if __name__ == "__main__":
    main()
