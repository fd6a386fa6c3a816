"""Sweep the fused mHC seam kernels' launches at the release dims (hc = 4, D = 5120); each variant is checked
against the reference first, within bench_mhc's bounds (bf16 outputs 2^-7 relative, mixes 1e-5: a launch
changes only the order of the sums).

    python scripts/sweep_mhc.py --out benchmarks/results          mhc_triton.py's kernel
    python scripts/sweep_mhc.py --rows --out benchmarks/results   mhc_rows_triton.py's kernel

Without --rows: tokens per program, columns per program and warps at 1 / 16 / 64 / 256 tokens (rows=False
keeps mhc_triton.py's kernel at any count). Its first sweep (11-30, at 64 and 1024 tokens) set the default
launches; the token blocks it found slow (16 tokens per program: 2-5x) are left out of the grid.

--rows: the rows kernels at 32 ... 4096 tokens (prefill chunks, batched decode, bounded replay's trimmed
layers at 128), beside mhc_triton.py's kernel at its default launch and the rows kernels at their default launch
(LAUNCH, split_plan's splits); it prints the fastest launch per token count and the smallest swept count from
which the rows kernel wins (for mhc_rows_triton.LAUNCH, TARGET_PROGRAMS and mhc.ROWS_MIN_TOKENS). Its grid: the
tiles of 8 values a thread (BLOCK_T BLOCK_D = 256 warps: 16 x 64 and 32 x 32 at 4 warps, 16 x 128, 32 x 64 and
64 x 32 at 8), the five fastest of the 11-30 sweep (mhc-rows-sweep-2026-11-30.json; smaller tiles were 2-9x
slower, larger ones spilled), TF32x3 dots only ("ieee" was 2.7-3.5x slower at every count), each with 1, 2,
4 ... 64 D splits as split_plan evens them out (64 of 80 chunks: 40), duplicates and launches of more than
2 TARGET_PROGRAMS programs left out (141 launches at 64 ... 4096 tokens); then the finishing launch's
RMSNorm tile (FINISH_NORM_BLOCKS), warps (FINISH_WARPS) and finish_split at the default tile. GPU time (12-02
o, 32 ... 4096 tokens with the finish grid): ~4 minutes. H200 12-02 o (mhc-rows-sweep-2026-12-02-o.json): the
rows kernels took 17.0 / 19.6 / 22.8 / 91 / 340 us at 32 / 64 / 128 / 1024 / 4096 tokens at their default.

--parts: where one seam's time goes, at 1 and 16 tokens: the whole seam at the default launch and a few others
(one program finishing a block, the RMSNorm after the Sinkhorn; norm_block: the finish's RMSNorm in one tile),
and the kernel with its runtime flags off (mixes only: GEMV + Sinkhorn finish, also with 1 Sinkhorn round
instead of 20; collapse only: expansion + RMSNorm finish; neither: launch, expansion and the counter; mixes
left as partials and mixes finish alone: the deferred seam's two launches, custom_ops/mhc_deferred.py), each
with `fn` hot in L2 (one copy) and cold (COLD_COPIES copies of fn in turn, as in a decode step, where the 80
seams' 2 MB each do not stay in the 50 MB L2).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_mhc import HC_EPS, ITERS, NORM_EPS, errors, make_case  # noqa: E402

from dsflash_compile.benchmarking import (print_table, run_metadata, save_results, sweep_variant,  # noqa: E402
                                          time_graph)
from dsflash_compile.custom_ops import mhc_rows_triton, mhc_triton  # noqa: E402
from dsflash_compile.custom_ops.mhc import SEAM_BLOCK_D, entry_seam_reference, seam_reference  # noqa: E402
from dsflash_compile.custom_ops.mhc_deferred import NORM_BLOCK  # noqa: E402
from dsflash_compile.custom_ops.mhc_mixes_finish_triton import mhc_mixes_finish_triton  # noqa: E402

COLUMNS = [("tokens", "tokens", "d"), ("tokens/program", "block_t", "d"), ("columns/program", "block_d", "d"),
           ("warps", "num_warps", "d"), ("us", "s", ".2f", 1e6), ("agrees", "agrees", "")]
ROWS_COLUMNS = [("tokens", "tokens", "d"), ("kernel", "kernel", ""), ("tokens/program", "block_t", "d"),
                ("columns/chunk", "block_d", "d"), ("warps", "num_warps", "d"), ("dot", "precision", ""),
                ("D splits", "splits", "d"), ("finish tile", "finish_norm_block", "d"),
                ("finish warps", "finish_warps", "d"), ("finish split", "finish_split", ""), ("us", "s", ".2f", 1e6),
                ("agrees", "agrees", "")]
SPLITS = (1, 2, 4, 8, 16, 32, 64)
FINISH_NORM_BLOCKS = (1024, 2048, 8192)  # the rows finish's RMSNorm tile and warps, swept at the default tile
FINISH_WARPS = (1, 2, 4, 8)
COLD_COPIES = 48
PARTS_COLUMNS = [("tokens", "tokens", "d"), ("part", "part", ""), ("fn", "fn", ""), ("us", "s", ".2f", 1e6),
                 ("agrees", "agrees", "")]


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
    """The rows kernel's grid (see the module docstring), its default launch and mhc_triton.py's kernel at its
    default launch."""
    args, agrees = case(tokens)
    dim = args[1].shape[-1]
    rows = [sweep_variant({"tokens": tokens, "kernel": "seam"},
                          lambda: mhc_triton.mhc_seam_triton(*args, rows=False), agrees)]
    launches = [("rows default", mhc_rows_triton.LAUNCH)]
    launches += [("rows", {**mhc_rows_triton.LAUNCH, "finish_norm_block": norm_block, "finish_warps": warps,
                           "finish_split": split})
                 for norm_block, warps, split in itertools.product(FINISH_NORM_BLOCKS, FINISH_WARPS, (False, True))]
    for block_t, block_d, warps in itertools.product((16, 32, 64), (32, 64, 128), (4, 8)):
        if block_t * block_d != 256 * warps:
            continue
        tile = {"block_t": block_t, "block_d": block_d, "num_warps": warps, "precision": "tf32x3"}
        seen = set()
        for wanted in SPLITS:
            blocks, splits, _ = mhc_rows_triton.split_plan(tokens, dim, {**tile, "splits": wanted})
            if splits not in seen and blocks * splits <= 2 * mhc_rows_triton.TARGET_PROGRAMS:
                seen.add(splits)
                launches.append(("rows", {**tile, "splits": splits}))
    for kernel, launch in launches:
        row = {"tokens": tokens, "kernel": kernel, **launch,
               "splits": mhc_rows_triton.split_plan(tokens, dim, launch)[1]}
        try:
            rows.append(sweep_variant(row, lambda: mhc_triton.mhc_seam_triton(*args, rows=True, rows_launch=launch),
                                      agrees))
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: reported, the sweep goes on
            rows.append({**row, "agrees": False, "error": f"{type(error).__name__}: {error}"[:300]})
            print(rows[-1], flush=True)
    return rows


def sweep_parts(tokens: int) -> list[dict]:
    """The seam's parts (module docstring), fn hot and cold; whole seams are checked against the reference."""
    args, agrees = case(tokens)
    out, streams, post, comb, pre_lagged, fn, scale, base, weight, *consts = args
    fns = [fn] + [fn.clone() for _ in range(COLD_COPIES - 1)]
    whole = {"default": {}, "one finishing program": {"share_finish": False}, "norm_block 8192": {"norm_block": 8192},
             "warps 2": {"num_warps": 2}, "block_d 128": {"block_d": 128}}
    parts = {f"seam, {name}": (lambda f, launch=launch: mhc_triton.mhc_seam_triton(
        out, streams, post, comb, pre_lagged, f, scale, base, weight, *consts, rows=False, **launch))
        for name, launch in whole.items()}
    parts["mixes only"] = lambda f: mhc_triton.mhc_seam_triton(None, streams, None, None, None, f, scale, base, None,
                                                               *consts, collapse=False)
    parts["mixes only, 1 Sinkhorn round"] = lambda f: mhc_triton.mhc_seam_triton(
        None, streams, None, None, None, f, scale, base, None, *consts[:2], 1, collapse=False)
    parts["collapse only"] = lambda f: mhc_triton.mhc_seam_triton(out, streams, post, comb, pre_lagged, None, None,
                                                                  None, weight, *consts, mixes=False)
    parts["neither"] = lambda f: mhc_triton.mhc_seam_triton(out, streams, post, comb, None, None, None, None, None,
                                                            *consts, mixes=False, collapse=False)
    # the deferred seam (custom_ops/mhc_deferred.py): the seam with its mixes left as partials, then the finish
    parts["mixes left as partials"] = lambda f: mhc_triton.mhc_seam_triton(
        out, streams, post, comb, pre_lagged, f, None, None, weight, *consts, block_d=SEAM_BLOCK_D, rows=False,
        finish_mixes=False)
    parts[f"mixes left as partials, norm_block {NORM_BLOCK}"] = lambda f: mhc_triton.mhc_seam_triton(
        out, streams, post, comb, pre_lagged, f, None, None, weight, *consts, block_d=SEAM_BLOCK_D, rows=False,
        finish_mixes=False, norm_block=NORM_BLOCK)
    partials = parts["mixes left as partials"](fn)[-1]
    parts["mixes finish alone"] = lambda f: mhc_mixes_finish_triton(partials, scale, base, *streams.shape[-2:],
                                                                    *consts)
    rows = []
    for name, call in parts.items():
        check = agrees(call(fn)) if name.startswith("seam") else "part"
        turn = iter(range(1 << 30))
        for label, pool in (("hot", fns[:1]), ("cold", fns)):
            row = {"tokens": tokens, "part": name, "fn": label, "agrees": check,
                   "s": time_graph(lambda: call(pool[next(turn) % len(pool)]), calls=len(fns))}
            print(row, flush=True)
            rows.append(row)
    return rows


def print_rows_summary(rows: list[dict], tokens: list[int]) -> None:
    """The fastest agreeing launch per token count against the one-token kernel, and the smallest swept count
    from which the rows kernel is faster at it and at every larger swept count."""
    wins = {}
    for n in tokens:
        seam = next(r for r in rows if r["tokens"] == n and r["kernel"] == "seam")
        best = min((r for r in rows if r["tokens"] == n and r["kernel"] == "rows" and r["agrees"] and r.get("s")),
                   key=lambda r: r["s"], default=None)
        default = next(r for r in rows if r["tokens"] == n and r["kernel"] == "rows default")
        wins[n] = best is not None and best["s"] < seam["s"]
        default_us = f"{default['s'] * 1e6:.1f} us" if default.get("s") else "failed"
        print(f"{n} tokens: one-token kernel {seam['s'] * 1e6:.1f} us, rows default launch {default_us} "
              f"(D splits: {default['splits']}), best rows launch {best}")
    from_here = [n for n in tokens if all(wins[m] for m in tokens if m >= n)]
    print(f"ROWS_MIN_TOKENS: {min(from_here) if from_here else 'none of ' + str(tokens)} (of the swept counts)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", action="store_true", help="sweep mhc_rows_triton.py's kernel instead")
    parser.add_argument("--parts", action="store_true", help="where one seam's time goes (module docstring)")
    parser.add_argument("--tokens", type=int, nargs="+",
                        help="default: 1 16 64 256, with --rows 32 ... 4096, with --parts 1 16")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_mhc.py needs a CUDA device")
    if args.parts:
        rows = [row for n in args.tokens or [1, 16] for row in sweep_parts(n)]
        save_results({**run_metadata(), "rows": rows}, "mhc-parts", args.out)
        print_table(rows, PARTS_COLUMNS)
        return
    tokens = args.tokens or ([32, 64, 128, 256, 1024, 4096] if args.rows else [1, 16, 64, 256])
    rows = [row for n in tokens for row in (sweep_rows(n) if args.rows else sweep(n))]
    # saved first: a launch that failed has no time, and the summaries below must not lose the run
    save_results({**run_metadata(), "rows": rows}, "mhc-rows-sweep" if args.rows else "mhc-sweep", args.out)
    print_table(rows, ROWS_COLUMNS if args.rows else COLUMNS)
    if args.rows:
        print_rows_summary(rows, tokens)
    else:
        for n in tokens:
            best = min((r for r in rows if r["tokens"] == n and r["agrees"]), key=lambda r: r["s"])
            print(f"best at {n} tokens: {best}")


if __name__ == "__main__":
    main()
