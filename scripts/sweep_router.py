"""Sweep `dsflash::fused_router`'s D splits (custom_ops/router_triton.py) on one GPU: the release's 384-expert gate
and flash-40l-e8's 8-expert one (D = 5120, top-6, normalised, x1.5) at decode token counts. Every variant is
checked against the reference first (the same expert ids, weights within 1e-5); then CUDA-graph times.

    python scripts/sweep_router.py --out benchmarks/results

The default splits bring the (token block, expert block) tiles up to about TARGET_PROGRAMS programs, which for
the 8-expert gate at one token means 40 programs of one 128-column block each, then two chained counters.
"""

from __future__ import annotations

import argparse

import torch

from dsflash_compile.benchmarking import fastest, print_table, run_metadata, save_results, sweep_variant
from dsflash_compile.custom_ops import router_triton
from dsflash_compile.moe import route

DIM, TOPK, NORMALIZE, SCALE = 5120, 6, True, 1.5
SPLITS = [1, 2, 4, 5, 8, 10, 20, 40]
COLUMNS = [("experts", "experts", "d"), ("tokens", "tokens", "d"), ("splits", "splits", ""), ("us", "s", ".2f", 1e6),
           ("agrees", "agrees", "")]


def sweep(experts: int, tokens: int, gen: torch.Generator) -> list[dict]:
    x = torch.randn(tokens, DIM, generator=gen, device="cuda").bfloat16()
    weight = (torch.randn(experts, DIM, generator=gen, device="cuda") * 8 / DIM ** 0.5).bfloat16()
    bias = torch.randn(experts, generator=gen, device="cuda") * 0.5
    want_w, want_ids = route(x, weight, bias, TOPK, NORMALIZE, SCALE)

    def agrees(got):
        weights, ids = got
        return bool(torch.equal(ids, want_ids)) and (weights - want_w).abs().max().item() <= 1e-5

    rows = []
    for splits in ["default", "early gate", *SPLITS]:  # numbers: the launch without EARLY_GATE, with that many
        row = {"experts": experts, "tokens": tokens, "splits": splits}
        chosen = None if isinstance(splits, str) else splits
        early = None if splits == "default" else splits == "early gate"
        sweep_variant(row, lambda: router_triton.fused_router_triton(x, weight, bias, TOPK, NORMALIZE, SCALE,
                                                                     splits=chosen, early_gate=early), agrees)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", nargs="+", type=int, default=[8, 384])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_router.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for experts in args.experts:
        for tokens in args.tokens:
            measured = sweep(experts, tokens, gen)
            print_table(fastest(measured)[:3] + [r for r in measured if r["splits"] == "default"], COLUMNS)
            results += measured
    save_results({**run_metadata(), "rows": results}, "router-sweep", args.out)


if __name__ == "__main__":
    main()
