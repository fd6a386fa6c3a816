"""Sweep `dsflash::grouped_mm`'s launch (the bf16 routed experts at decode) against torch._grouped_mm on the
flash-40l-e8 shapes (8 routed experts, top-6; w1/w3 2304 x 5120, w2 5120 x 2304) at batch 1..64, with the shared
expert as the stacks' ninth slice and every token's seventh row (compile()'s moe_shared_stacked, the default).
Every variant's output is checked against torch._grouped_mm first (bench_native.py's case and error). Picks the
launches of custom_ops/mxfp4_experts_triton.py (BF16_LAUNCHES) and compile()'s moe_few_rows (the largest batch x 7
rows where the kernel still wins).

    python scripts/sweep_experts.py --out benchmarks/results
    python scripts/sweep_experts.py --tokens 1 --full     (every launch variant at batch 1 only)
    python scripts/sweep_experts.py --tokens 16 32 64 --tall   (taller row tiles: many rows per expert)
    python scripts/sweep_experts.py --tokens 32 64 --swiglu    (dsflash::grouped_swiglu against w1 + w3 alone)

--swiglu times dsflash::grouped_swiglu's launches (x read through the pairs' order, w1 and w3 side by side, the
SwiGLU and FP8 epilogue) against the two grouped GEMMs it replaces, without the gather and epilogue kernels
that also ran around them (so the op's lead is understated by those).

At batch 1 every launch variant runs; at the other batch sizes the default and the batch-1 winner.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench_native import EXPERT_PROJECTIONS, TOPK, error, experts_case
from dsflash_compile.benchmarking import fastest, print_table, run_metadata, save_results, sweep_variant, time_graph
from dsflash_compile.custom_ops import mxfp4_experts_triton as kernels

EXPERTS = 8
TOKENS = [1, 2, 4, 8, 16, 32, 64]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); 64 x 256 at 4 warps spills registers on sm_90
# (tests/test_native_weights.py). --tall: the taller row tiles for many rows per expert (batch 32-64)
DEFAULT = kernels.BF16_LAUNCHES[0][1]  # the few-rows launch (up to 8 rows a slice: batch <= 8)
VARIANTS = [(DEFAULT[0], *v) for v in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (2, 3, 4))
            if v[:3] != (64, 256, 4)]
TALL_VARIANTS = list(itertools.product((32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4)))
# dsflash::grouped_swiglu: the launches that compile without spills (tests/test_grouped_swiglu.py)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
SWIGLU_VARIANTS = [(64, 32, 64, 4, 4), (64, 64, 64, 8, 3), (64, 64, 64, 8, 4), (32, 32, 64, 4, 3)]
COLUMNS = [("tokens", "tokens", "d"), ("proj", "proj", ""), ("block_m", "block_m", "d"), ("block_n", "block_n", "d"),
           ("block_k", "block_k", "d"), ("warps", "num_warps", "d"), ("stages", "num_stages", "d"),
           ("us", "s", ".1f", 1e6), ("TB/s", "tb_per_s", ".2f"), ("x torch", "vs_torch", ".2f"),
           ("agrees", "agrees", "")]


def sweep(tokens: int, proj: str, variants: list[tuple], gen: torch.Generator) -> list[dict]:
    n, k = EXPERT_PROJECTIONS[f"experts.{proj}"]
    x, _, _, offsets, weight, want, mag, used = experts_case(n, k, tokens, gen, experts=EXPERTS, shared=True,
                                                             mxfp4=False)
    nbytes = used * 2 * weight.numel()  # the picked experts' bf16 bytes
    torch_s = time_graph(lambda: torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets))
    rows = [{"tokens": tokens, "proj": proj, "path": "torch._grouped_mm", "s": torch_s, "vs_torch": 1.0,
             "tb_per_s": nbytes / torch_s / 1e12, "agrees": True}]
    for block_m, block_n, block_k, warps, stages in variants:
        def call():
            return kernels.grouped_mm_triton(x, weight, None, offsets, block_m=block_m, block_n=block_n,
                                             block_k=block_k, num_warps=warps, num_stages=stages)
        row = {"tokens": tokens, "proj": proj, "path": "triton", "block_m": block_m, "block_n": block_n,
               "block_k": block_k, "num_warps": warps, "num_stages": stages}
        try:
            sweep_variant(row, call, lambda out: error(out, want, mag) <= 2 ** -8)  # bf16 rounding: ~2^-9 of mag
            row.update(vs_torch=torch_s / row["s"], tb_per_s=nbytes / row["s"] / 1e12)
        except Exception as failure:  # noqa: BLE001 - e.g. out of shared memory: reported, the sweep goes on
            row.update(agrees=False, error=f"{type(failure).__name__}: {failure}"[:300])
            print(row, flush=True)
        rows.append(row)
    return rows


def sweep_swiglu(tokens: int, variants: list[tuple], gen: torch.Generator) -> list[dict]:
    from dsflash_compile.custom_ops.expert_order import expert_order_reference
    from dsflash_compile.custom_ops.grouped_swiglu import grouped_swiglu_reference
    from dsflash_compile.custom_ops.grouped_swiglu_triton import grouped_swiglu_triton, launch as default_launch
    from dsflash_compile.quant import fp8_qdq

    inter, dim = EXPERT_PROJECTIONS["experts.w1"]
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen, device="cuda")[:TOPK] for _ in range(tokens)])
    ids = torch.cat([ids, torch.full_like(ids[:, :1], EXPERTS)], 1)  # the shared expert, stacked last
    order, _, offsets, _ = (t.cuda() for t in expert_order_reference(ids.cpu(), EXPERTS + 1))
    weights = torch.rand(ids.shape, generator=gen, device="cuda")
    x = fp8_qdq(torch.randn(tokens, dim, generator=gen, device="cuda").bfloat16())
    w1, w3 = ((torch.randn(EXPERTS + 1, inter, dim, generator=gen, device="cuda") * dim ** -0.5).bfloat16()
              for _ in range(2))
    args = (x, weights, order, w1, w3, offsets, 10.0, True)
    want = grouped_swiglu_reference(*args).float()
    nbytes = 2 * 2 * w1.numel()  # every slice is picked at these batches
    xs = x[order // ids.shape[1]]
    gemms_s = time_graph(lambda: (kernels.grouped_mm_triton(xs, w1, None, offsets),
                                  kernels.grouped_mm_triton(xs, w3, None, offsets)))
    rows = [{"tokens": tokens, "proj": "w1+w3", "path": "two grouped_mm", "s": gemms_s, "vs_torch": 1.0,
             "tb_per_s": nbytes / gemms_s / 1e12, "agrees": True}]
    for variant in variants:  # None: the default launch
        keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
        launch = dict(zip(keys, variant)) if variant else default_launch(order.numel(), EXPERTS + 1)
        row = {"tokens": tokens, "proj": "w1+w3", "path": "grouped_swiglu" + ("" if variant else " (default)"),
               **launch}
        try:  # FP8 of h: a GEMM's summation order can move one E4M3 step (2^-4 of a group's largest value)
            sweep_variant(row, lambda: grouped_swiglu_triton(*args, **launch),
                          lambda h: ((h.float() - want).abs().max() / want.abs().max()).item() <= 2e-2)
            row.update(vs_torch=gemms_s / row["s"], tb_per_s=nbytes / row["s"] / 1e12)
        except Exception as failure:  # noqa: BLE001 - reported, the sweep goes on
            row.update(agrees=False, error=f"{type(failure).__name__}: {failure}"[:300])
            print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    parser.add_argument("--full", action="store_true", help="every launch variant at every batch size")
    parser.add_argument("--tall", action="store_true", help="the taller row tiles (TALL_VARIANTS) and the default "
                        "at every batch size, not the batch-1 grid")
    parser.add_argument("--swiglu", action="store_true", help="dsflash::grouped_swiglu's launches (SWIGLU_VARIANTS "
                        "and the default) against the two grouped GEMMs it replaces")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_experts.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, best = [], {}
    if args.swiglu:
        for tokens in args.tokens:
            results += sweep_swiglu(tokens, [None, *SWIGLU_VARIANTS], gen)
            print_table(fastest(r for r in results if r["tokens"] == tokens)[:12], COLUMNS)
            save_results({**run_metadata(), "rows": results}, "swiglu-sweep", args.out)
        return
    for tokens in args.tokens:  # saved after each batch size so a cut run keeps what it measured
        for proj in ("w1", "w2"):
            if args.tall:
                variants = [DEFAULT, *TALL_VARIANTS]
            else:
                variants = VARIANTS if args.full or tokens == 1 else sorted({DEFAULT, best.get(proj, DEFAULT)})
            measured = sweep(tokens, proj, variants, gen)
            if tokens == 1 and not args.tall:
                top = next(r for r in fastest(measured) if r["path"] == "triton")
                best[proj] = tuple(top[key] for key in ("block_m", "block_n", "block_k", "num_warps", "num_stages"))
            print_table(fastest(measured)[:12], COLUMNS)
            results += measured
        save_results({**run_metadata(), "default": DEFAULT, "best_at_batch_1": best, "rows": results},
                     "experts-sweep", args.out)


if __name__ == "__main__":
    main()
