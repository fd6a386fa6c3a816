"""Sweep `dsflash::routed_experts`' launches (custom_ops/routed_experts_triton.py), one kernel at a time, on the
flash-40l-e8 shapes: 8 routed experts + the shared one stacked (9 slices), top-6 + shared (7 pairs a token),
D 5120, I 2304, at decode batch sizes, called as MoE calls it (x quantized and the shared pair added in the op).
Every variant's output is checked against the op's reference first (within the GEMMs' summation order: 2e-2 of
the largest value, as tests/test_moe_small.py); then the whole op (up, down with the sum) is timed as CUDA-graph replays
with only the swept kernel's launch changed, so the differences are that kernel's. Picks UP_BLOCK_N, DOWN_BLOCK_N
and the launches of `launches`.

    python scripts/sweep_routed.py --kernel down --out benchmarks/results
    python scripts/sweep_routed.py --kernel up --tokens 1 --top 6

At the first batch size every variant runs; at the others the default and the `--top` fastest of the first.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from dsflash_compile.benchmarking import fastest, print_table, run_metadata, save_results, sweep_variant
from dsflash_compile.custom_ops import routed_experts_triton as kernels
from dsflash_compile.custom_ops.routed_experts import routed_experts_reference

EXPERTS, SLOTS, DIM, INTER, LIMIT = 9, 7, 5120, 2304, 10.0
TOKENS = [1, 8, 16]
# (block_n, block_k, warps, stages, maxnreg); the up kernel's block_n is a multiple of 32 (its FP8 groups of h)
VARIANTS = {"down": list(itertools.product((16, 32, 64, 128), (128, 256), (2, 4, 8), (2, 3), (None,))),
            "up": list(itertools.product((32, 64), (64, 128, 256), (2, 4, 8), (2, 3), (None,)))}
COLUMNS = [("tokens", "tokens", "d"), ("block_n", "block_n", "d"), ("block_k", "block_k", "d"),
           ("warps", "num_warps", "d"), ("stages", "num_stages", "d"), ("maxnreg", "maxnreg", ""),
           ("op us", "s", ".1f", 1e6),
           ("agrees", "agrees", "")]


def case(tokens: int, gen: torch.Generator):
    """The op's arguments: random routing (distinct experts per token; the shared one, the last slice, added by
    the op) and random bf16 data."""
    kw = dict(device="cuda", generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS - 1, **kw)[:SLOTS - 1] for _ in range(tokens)])
    weights = torch.rand(tokens, SLOTS - 1, **kw)
    x = torch.randn(tokens, DIM, **kw).bfloat16()
    w1, w3 = ((torch.randn(EXPERTS, INTER, DIM, **kw) / 64).bfloat16() for _ in range(2))
    w2 = (torch.randn(EXPERTS, DIM, INTER, **kw) / 64).bfloat16()
    return x, weights, ids, w1, w3, w2, LIMIT, True, True, EXPERTS - 1


def sweep(kernel: str, tokens: int, variants: list[tuple], gen: torch.Generator) -> list[dict]:
    args = case(tokens, gen)
    want = routed_experts_reference(*args)
    scale = want.abs().max()

    def agrees(got):
        return ((got - want).abs().max() / scale).item() <= 2e-2

    rows = []
    for block_n, block_k, warps, stages, maxnreg in variants:
        launch = {"block_n": block_n, "block_k": block_k, "num_warps": warps, "num_stages": stages,
                  "maxnreg": maxnreg}
        row = {"kernel": kernel, "tokens": tokens, **launch}
        try:
            rows.append(sweep_variant(
                row, lambda: kernels.routed_experts_triton(*args, **{kernel: launch}), agrees))
        except Exception as error:  # noqa: BLE001 - e.g. out of resources: reported, the sweep goes on
            rows.append({**row, "agrees": False, "error": f"{type(error).__name__}: {error}"[:300]})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=sorted(VARIANTS), default="down")
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    parser.add_argument("--launches", nargs="+", metavar="N,K,WARPS,STAGES[,MAXNREG]",
                        help="these launches instead of the grid (with the default)")
    parser.add_argument("--top", type=int, default=4, help="variants of the first batch size timed at the others")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_routed.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    launch = dict(zip(("up", "down"), kernels.launches(args.tokens[0])))[args.kernel]
    default = (launch["block_n"], launch["block_k"], launch["num_warps"], launch["num_stages"], launch["maxnreg"])
    grid = VARIANTS[args.kernel] if not args.launches else [
        tuple(int(v) for v in text.split(",")) + (None,) * (5 - len(text.split(","))) for text in args.launches]
    results = []
    for n, tokens in enumerate(args.tokens):  # saved after each batch size so a cut run keeps what it measured
        if n == 0:
            variants = [default] + [v for v in dict.fromkeys(grid) if v != default]
        else:
            timed = fastest(r for r in results if r["tokens"] == args.tokens[0])
            variants = list(dict.fromkeys([default] + [
                (r["block_n"], r["block_k"], r["num_warps"], r["num_stages"], r["maxnreg"]) for r in timed[:args.top]]))
        measured = sweep(args.kernel, tokens, variants, gen)
        print_table(sorted((r for r in measured if "s" in r), key=lambda r: r["s"])[:12], COLUMNS)
        results += measured
        save_results({**run_metadata(), "kernel": args.kernel, "default": default, "rows": results},
                     f"routed-{args.kernel}-sweep", args.out)


if __name__ == "__main__":
    main()
