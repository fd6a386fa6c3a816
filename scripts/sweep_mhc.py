"""Sweep the fused mHC seam kernels' launches at the release dims (hc = 4, D = 5120); each variant is checked
against the reference first, within bench_mhc's bounds (bf16 outputs 2^-7 relative, mixes 1e-5: a launch
changes only the order of the sums).

    python scripts/sweep_mhc.py --out benchmarks/results          mhc_triton.py's kernel
    python scripts/sweep_mhc.py --rows --out benchmarks/results   mhc_rows_triton.py's kernel

Without --rows: tokens per program, columns per program and warps at 1 / 16 / 64 / 256 tokens (rows=False
keeps mhc_triton.py's kernel at any count). Its first sweep (11-30, at 64 and 1024 tokens) set the default
launches; the token blocks it found slow (16 tokens per program: 2-5x) are left out of the grid.

--rows: the rows kernel at 64 ... 8192 tokens (prefill chunks, batched decode), beside mhc_triton.py's kernel
at its default launch; it prints the fastest launch per token count and the smallest swept count from which
the rows kernel wins (for mhc_rows_triton.LAUNCH and ROWS_MIN_TOKENS). Its grid: BLOCK_T 16/32/64, BLOCK_D
32/64/128, 4/8 warps, "ieee"/"tf32x3" dots, keeping the tiles of at most 8 values per thread (BLOCK_T BLOCK_D
<= 256 warps): 18 launches. The larger tiles spilled registers in offline sm_90 compiles (some also exceed
the shared memory) and take 5-40 s each to compile; of the 18, four tf32x3 launches spill 8-256 bytes.
GPU time: about 1 minute of compiles (the 18 took 45 s on a 2-core machine, plus the one-token kernel) and
some 10 s of runs (5 x 19 variants, each a check and 221 calls; at 8192 tokens the rows kernel should take
under 1 ms, the one-token kernel about 3 ms).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_mhc import HC_EPS, ITERS, NORM_EPS, errors, make_case  # noqa: E402

from dsflash_compile.benchmarking import print_table, run_metadata, save_results, sweep_variant  # noqa: E402
from dsflash_compile.custom_ops import mhc_triton  # noqa: E402
from dsflash_compile.custom_ops.mhc import entry_seam_reference, seam_reference  # noqa: E402

COLUMNS = [("tokens", "tokens", "d"), ("tokens/program", "block_t", "d"), ("columns/program", "block_d", "d"),
           ("warps", "num_warps", "d"), ("us", "s", ".2f", 1e6), ("agrees", "agrees", "")]
ROWS_COLUMNS = [("tokens", "tokens", "d"), ("kernel", "kernel", ""), ("tokens/program", "block_t", "d"),
                ("columns/program", "block_d", "d"), ("warps", "num_warps", "d"), ("dot", "precision", ""),
                ("us", "s", ".2f", 1e6), ("agrees", "agrees", "")]


def case(tokens: int):
    """(the seam's arguments, agrees(outputs) -> bool) for a decode-shaped case of `tokens` tokens."""
    c = make_case(tokens, torch.Generator(device="cuda").manual_seed(tokens))
    args = (c["out"], c["streams"], c["post"], c["comb"], c["pre_lagged"], c["fn"], c["scale"], c["base"],
            c["norm_weight"], NORM_EPS, HC_EPS, ITERS)
    want_streams = seam_reference(*args)[0]

    def agrees(got):  # bench_mhc's bounds against the reference (a launch changes the order of the sums only)
        own = entry_seam_reference(got[0], *args[4:])
        return (errors(got[:1], [want_streams])["rel"] <= 2 ** -7 and errors(got[1:2], own[:1])["rel"] <= 2 ** -7
                and errors(got[2:], own[1:])["abs"] <= 1e-5)
    return args, agrees


def sweep(tokens: int) -> list[dict]:
    args, agrees = case(tokens)
    rows = []
    for block_t, block_d, warps in itertools.product((1, 2, 4), (32, 64, 128, 256), (2, 4, 8)):
        if block_t > max(1, tokens):
            continue

        def call():
            return mhc_triton.mhc_seam_triton(*args, block_t=block_t, block_d=block_d, num_warps=warps, rows=False)
        rows.append(sweep_variant({"tokens": tokens, "block_t": block_t, "block_d": block_d, "num_warps": warps},
                                  call, agrees))
    return rows


def sweep_rows(tokens: int) -> list[dict]:
    """The rows kernel's grid (see the module docstring) and mhc_triton.py's kernel at its default launch."""
    args, agrees = case(tokens)
    rows = [sweep_variant({"tokens": tokens, "kernel": "seam"},
                          lambda: mhc_triton.mhc_seam_triton(*args, rows=False), agrees)]
    for block_t, block_d, warps, precision in itertools.product((16, 32, 64), (32, 64, 128), (4, 8),
                                                                ("ieee", "tf32x3")):
        if block_t * block_d > 256 * warps:
            continue
        launch = {"block_t": block_t, "block_d": block_d, "num_warps": warps, "precision": precision}
        row = {"tokens": tokens, "kernel": "rows", **launch}
        try:
            rows.append(sweep_variant(row, lambda: mhc_triton.mhc_seam_triton(*args, rows=True, rows_launch=launch),
                                      agrees))
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: reported, the sweep goes on
            rows.append({**row, "agrees": False, "error": f"{type(error).__name__}: {error}"[:300]})
            print(rows[-1], flush=True)
    return rows


def print_rows_summary(rows: list[dict], tokens: list[int]) -> None:
    """The fastest agreeing launch per token count against the one-token kernel, and the smallest swept count
    from which the rows kernel is faster at it and at every larger swept count."""
    wins = {}
    for n in tokens:
        seam = next(r for r in rows if r["tokens"] == n and r["kernel"] == "seam")
        best = min((r for r in rows if r["tokens"] == n and r["kernel"] == "rows" and r["agrees"]),
                   key=lambda r: r["s"], default=None)
        wins[n] = best is not None and best["s"] < seam["s"]
        print(f"{n} tokens: one-token kernel {seam['s'] * 1e6:.1f} us, best rows launch {best}")
    from_here = [n for n in tokens if all(wins[m] for m in tokens if m >= n)]
    print(f"ROWS_MIN_TOKENS: {min(from_here) if from_here else 'none of ' + str(tokens)} (of the swept counts)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", action="store_true", help="sweep mhc_rows_triton.py's kernel instead")
    parser.add_argument("--tokens", type=int, nargs="+", help="default: 1 16 64 256, with --rows 64 ... 8192")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_mhc.py needs a CUDA device")
    tokens = args.tokens or ([64, 256, 1024, 4096, 8192] if args.rows else [1, 16, 64, 256])
    rows = [row for n in tokens for row in (sweep_rows(n) if args.rows else sweep(n))]
    print_table(rows, ROWS_COLUMNS if args.rows else COLUMNS)
    if args.rows:
        print_rows_summary(rows, tokens)
    else:
        for n in tokens:
            best = min((r for r in rows if r["tokens"] == n and r["agrees"]), key=lambda r: r["s"])
            print(f"best at {n} tokens: {best}")
    save_results({**run_metadata(), "rows": rows}, "mhc-rows-sweep" if args.rows else "mhc-sweep", args.out)


if __name__ == "__main__":
    main()
