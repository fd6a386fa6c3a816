"""Sweep `dsflash::bf16_linear`'s launches (custom_ops/bf16_linear_triton.py) against cuBLAS on the flash-40l-e8
bf16 decode projections, side by side in one run.

For each projection and row count: cuBLAS as the compiled model ran it before the op (`layers.block_diagonal_
linear` on an input already FP8-rounded: the FP8 kernel in front of it is not timed, so the op's lead is
understated by that kernel), then the op's default launch and a grid of (block_n, block_k, splits, warps,
stages) with the input's FP8 in the launch. Every variant is checked against the reference first (2^-7 of the
largest output: a GEMM's summation order); then CUDA-graph times and the bandwidth in weight bytes per second.

    python scripts/sweep_linear.py --out benchmarks/results
    python scripts/sweep_linear.py --rows 1 --only wo_b
    python scripts/sweep_linear.py --rows 64 --grid tall --prequantized   # decode batch 64: the GEMM alone

--prequantized gives the op the FP8-rounded input with quantize_x off (as cuBLAS gets it): at 64 rows every
output block would round the whole row tile again, so there the rounding belongs in the kernel before it.

At the first row count every variant runs; at the others the default and the `--top` fastest of the first.

At one row the sweep also times bf16_linear_gemv_triton.py's kernel (one tile a program) at every projection, its
default launch and GEMV_GRID's (`--grid none`: only those, cuBLAS and bf16_linear's default launch).

--after-seam instead times one row's projection as a decode layer runs it, right after an mHC seam (whose output
is its input): seam -> projection over --layers layers, each with its own weight and seam `fn`, in one CUDA
graph with PDL, for the one-row kernels (bf16_linear_gemv_triton.py's, bf16_linear_triton.py's tiled one); then
the seams alone. Each projection's share is (pair - seam alone) per layer; the order rotates by round.

--after-wq-b times the indexer's wq_b as an index layer runs it, right after the attention's wq_b on the same row
(the one-row TMA GEMV of 84 MB): row -> wq_b -> the indexer's wq_b over --layers layers in one CUDA graph with PDL,
its GEMV waiting first (the default), reading and summing before its wait (`early`: the early launch, a K loop) and
early on the default launch; then wq_b alone. The indexer's share is (pair - wq_b alone) per layer
(CompileOptions.early_gemv, passes/early_reads.py).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_mhc import HC_EPS, ITERS, NORM_EPS, make_case  # noqa: E402

from dsflash_compile.benchmarking import (fastest, print_table, run_metadata, save_results,  # noqa: E402
                                          sweep_variant, time_graph)
from dsflash_compile.custom_ops import bf16_linear_gemv_triton as gemv  # noqa: E402
from dsflash_compile.custom_ops import bf16_linear_triton as kernels  # noqa: E402
from dsflash_compile.custom_ops.bf16_linear import bf16_linear_reference  # noqa: E402
from dsflash_compile.custom_ops.mhc_triton import mhc_seam_triton  # noqa: E402
from dsflash_compile.layers import block_diagonal_linear  # noqa: E402
from dsflash_compile.quant import fp8_qdq  # noqa: E402

# (K per group, N, groups, quantize_x), as in tests/test_bf16_linear.py
PROJECTIONS = {"wq_a+wkv": (5120, 1792, 1, True), "wq_b": (1280, 32768, 1, True), "wo_a": (4096, 8192, 8, False),
               "wo_b": (8192, 5120, 1, True), "indexer_wq_b": (1280, 4096, 1, True)}
ROWS = [1, 8, 16]
# (block_n, block_k, splits as a multiple of the default's, warps, stages)
GRIDS = {"few": list(itertools.product((32, 64, 128), (64, 128, 256), (0.5, 1, 2), (2, 4), (2, 4))),
         "tall": list(itertools.product((32, 64, 128), (64, 128), (1, 2), (4, 8), (3, 4))),  # 33-64 rows
         "none": []}
# bf16_linear_gemv_triton.py's launches at one row: (block_n, block_k, warps); its default first
# (block_n, block_k, warps, k_chunks); None: the shape's default (gemv.launch); k_chunks "whole": every tile of a
# row a program (no split), as gemv.launch picks for wq_a+wkv; untimed at the other projections (indexer wq_b)
GEMV_GRID = [None] + list(itertools.product((16, 32), (512, 1024, 2048), (4, 8), (1,))) + list(
    itertools.product((4, 8), (256, 1024), (4, 8), ("whole",)))
# --after-seam: bf16_linear_gemv_triton.py's launches besides its default (block_n, block_k, warps, k_chunks): K split
# in tiles (the default before whole rows), whole rows of K a program at other widths and warps
AFTER_SEAM_GEMV = [(16, 1024, 4, 1), (4, 1024, 4, 5), (8, 1024, 8, 5), (2, 1024, 4, 5)]
COLUMNS = [("proj", "proj", ""), ("rows", "rows", "d"), ("kernel", "kernel", ""), ("block_n", "block_n", ""),
           ("block_k", "block_k", ""), ("k_chunks", "k_chunks", ""), ("splits", "splits", ""),
           ("warps", "num_warps", ""),
           ("stages", "num_stages", ""), ("us", "s", ".2f", 1e6), ("TB/s", "tbps", ".2f"),
           ("vs cuBLAS", "vs_cublas", ".2f"), ("agrees", "agrees", "")]


def sweep(name: str, rows: int, variants: list, gen: torch.Generator, prequantized: bool) -> list[dict]:
    k, n, groups, quantize = PROJECTIONS[name]
    x = torch.randn(rows, groups * k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / 64).bfloat16()
    want = bf16_linear_reference(x, w, groups, quantize)
    scale = want.abs().max()
    weight_bytes = w.numel() * 2

    def agrees(got):
        return ((got - want).abs().max() / scale).item() <= 2 ** -7

    ready = fp8_qdq(x) if quantize else x
    if prequantized:
        x, quantize = ready, False
    cublas = time_graph(lambda: block_diagonal_linear(ready, w, groups))
    base = {"proj": name, "rows": rows, "prequantized": prequantized}
    measured = [{**base, "kernel": "cuBLAS", "block_n": "-", "s": cublas, "tbps": weight_bytes / cublas / 1e12,
                 "vs_cublas": 1.0, "agrees": True}]
    for variant in GEMV_GRID if rows == 1 else []:
        launch = gemv.launch(n, k, groups, torch.cuda.get_device_properties(0).multi_processor_count)
        if variant is not None:
            launch = dict(zip(("block_n", "block_k", "num_warps", "k_chunks"), variant))
            if launch["k_chunks"] == "whole":
                launch["k_chunks"] = -(-k // launch["block_k"])
        if not gemv.takes(rows, n, k, groups, sms=None) or (n // groups) % launch["block_n"]:
            continue
        row = {**base, "kernel": "gemv", **launch, "variant": "default" if variant is None else variant}
        try:
            sweep_variant(row, lambda: gemv.bf16_linear_gemv(x, w, groups, quantize, **launch), agrees)
            row.update(tbps=weight_bytes / row["s"] / 1e12, vs_cublas=cublas / row["s"])
        except Exception as error:  # noqa: BLE001 - e.g. out of resources: reported, the sweep goes on
            row.update(agrees=False, error=f"{type(error).__name__}: {error}"[:300])
        measured.append(row)
    default = kernels.launch(rows, n, k, groups, x.device, quantize)
    for variant in variants:
        if variant == "default":
            launch = dict(default)
        else:
            block_n, block_k, split_factor, warps, stages = variant
            if (n // groups) % block_n:
                continue
            launch = kernels.launch(rows, n, k, groups, x.device, quantize, block_n=block_n, block_k=block_k,
                                    num_warps=warps, num_stages=stages)
            launch["splits"] = max(1, round(launch["splits"] * split_factor))
        launch.pop("block_m")
        row = {**base, "kernel": "tiled", **launch, "variant": variant}
        try:
            sweep_variant(row, lambda: kernels.bf16_linear_triton(x, w, groups, quantize, **launch), agrees)
            row.update(tbps=weight_bytes / row["s"] / 1e12, vs_cublas=cublas / row["s"])
        except Exception as error:  # noqa: BLE001 - e.g. out of resources: reported, the sweep goes on
            row.update(agrees=False, error=f"{type(error).__name__}: {error}"[:300])
            print(row, flush=True)
        measured.append(row)
    return measured


def rotated_times(projections: dict, run, rounds: int, layers: int) -> dict:
    """{label: seconds a layer of run(projection), one per round}: each label's CUDA graph of `layers` layers timed in
    turn, the order rotating by round."""
    times = {label: [] for label in projections}
    labels = list(projections)
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            times[label].append(time_graph(lambda: run(projections[label]), calls=2, replays=20) / layers)
    return times


def after_seam(name: str, layers: int, rounds: int, gen: torch.Generator) -> list[dict]:
    k, n, groups, quantize = PROJECTIONS[name]
    if groups != 1 or k != 5120:
        raise SystemExit(f"--after-seam: {name} does not take the seam's [1, 5120] output")
    cases = [make_case(1, gen) for _ in range(layers)]
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16() for _ in range(layers)]
    seam_args = [(c["out"], c["streams"], c["post"], c["comb"], c["pre_lagged"], c["fn"], c["scale"], c["base"],
                  c["norm_weight"], NORM_EPS, HC_EPS, ITERS) for c in cases]
    projections = {
        "gemv": lambda x, w: gemv.bf16_linear_gemv(x, w, 1, quantize),
        **{f"gemv {n_}x{k_}x{c}, {warps} warps": (
            lambda x, w, n_=n_, k_=k_, warps=warps, c=c: gemv.bf16_linear_gemv(x, w, 1, quantize, n_, k_, warps, c))
           for n_, k_, warps, c in AFTER_SEAM_GEMV},
        "tiled": lambda x, w: kernels.bf16_linear_triton(x, w, 1, quantize),
        "seam alone": None,
    }

    def run(projection):
        outs = []
        for args, w in zip(seam_args, weights):
            normed = mhc_seam_triton(*args)[1].view(1, k)
            outs.append(normed if projection is None else projection(normed, w))
        return outs

    want = [bf16_linear_reference(x, w, 1, quantize) for x, w in zip(run(None), weights)]
    agrees = {label: label == "seam alone" or all(((g - r).abs().max() / r.abs().max()).item() <= 2 ** -7
                                                  for g, r in zip(run(fn), want))
              for label, fn in projections.items()}
    times = rotated_times(projections, run, rounds, layers)
    seam = statistics.median(times["seam alone"])
    rows = [{"proj": name, "variant": label, "s": statistics.median(ts), "rounds_s": ts, "agrees": agrees[label],
             "projection_s": statistics.median(ts) - seam if label != "seam alone" else None, "layers": layers}
            for label, ts in times.items()]
    tiled = next(r["projection_s"] for r in rows if r["variant"] == "tiled")
    for row in rows:
        if row["projection_s"] is not None:
            row["vs_tiled"] = tiled / row["projection_s"]
    return rows


def after_wq_b(layers: int, rounds: int, gen: torch.Generator) -> list[dict]:
    k, n, _, quantize = PROJECTIONS["indexer_wq_b"]
    big = [(torch.randn(PROJECTIONS["wq_b"][1], k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
           for _ in range(layers)]
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16() for _ in range(layers)]
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    default_launch = gemv.launch(n, k, 1, torch.cuda.get_device_properties(0).multi_processor_count)
    projections = {
        "waits first": lambda row, q, w: torch.ops.dsflash.bf16_gemv(row, w, 1, quantize),
        "early": lambda row, q, w: torch.ops.dsflash.bf16_gemv(row, w, 1, quantize, after=q, early=True),
        "early, default launch": lambda row, q, w: gemv.bf16_linear_gemv(row, w, 1, quantize, early=True,
                                                                         loop=False, **default_launch),
        "wq_b alone": None,
    }

    def run(projection):
        outs = []
        for b, w in zip(big, weights):
            row = x * 1  # the row's producer: wq_b's kernel runs between it and the indexer's
            q = torch.ops.dsflash.bf16_gemv(row, b, 1, quantize)
            outs.append(q if projection is None else projection(row, q, w))
        return outs

    want = bf16_linear_reference(x, weights[0], 1, quantize)
    agrees = {label: label == "wq_b alone" or ((run(fn)[0] - want).abs().max() / want.abs().max()).item() <= 2 ** -7
              for label, fn in projections.items()}
    times = rotated_times(projections, run, rounds, layers)
    alone = statistics.median(times["wq_b alone"])
    return [{"proj": "indexer_wq_b", "variant": label, "s": statistics.median(ts), "rounds_s": ts,
             "agrees": agrees[label], "layers": layers,
             "projection_s": None if label == "wq_b alone" else statistics.median(ts) - alone}
            for label, ts in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=ROWS)
    parser.add_argument("--only", nargs="+", choices=sorted(PROJECTIONS), default=list(PROJECTIONS))
    parser.add_argument("--grid", choices=sorted(GRIDS), default="few", help="launch variants at the first row count")
    parser.add_argument("--prequantized", action="store_true", help="the op gets the FP8-rounded input")
    parser.add_argument("--top", type=int, default=4, help="variants of the first row count timed at the others")
    parser.add_argument("--after-seam", action="store_true", help="time --only's projections after a seam instead")
    parser.add_argument("--after-wq-b", action="store_true",
                        help="time the indexer's wq_b after the attention's, waiting first or early, instead")
    parser.add_argument("--layers", type=int, default=8, help="--after-*: layers, each with its own weights")
    parser.add_argument("--rounds", type=int, default=5, help="--after-*: rounds, the order rotating")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_linear.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.after_wq_b:
        results = after_wq_b(args.layers, args.rounds, gen)
        print_table(results, [("variant", "variant", ""), ("us / layer", "s", ".2f", 1e6),
                              ("indexer us", "projection_s", ".2f", 1e6), ("agrees", "agrees", "")])
        save_results({**run_metadata(), "after_wq_b": True, "rows": results}, "linear-after-wq-b", args.out)
        return
    if args.after_seam:
        results = [row for name in args.only for row in after_seam(name, args.layers, args.rounds, gen)]
        print_table(results, [("proj", "proj", ""), ("variant", "variant", ""), ("us / layer", "s", ".2f", 1e6),
                              ("projection us", "projection_s", ".2f", 1e6), ("vs tiled", "vs_tiled", ".2f"),
                              ("agrees", "agrees", "")])
        save_results({**run_metadata(), "after_seam": True, "rows": results}, "linear-after-seam", args.out)
        return
    results = []
    for i, rows in enumerate(args.rows):  # saved after each row count so a cut run keeps what it measured
        for name in args.only:
            if i == 0:
                variants = ["default", *GRIDS[args.grid]]
            else:
                timed = fastest(r for r in results if r["proj"] == name and r["rows"] == args.rows[0]
                                and "variant" in r)  # not the cuBLAS row
                variants = ["default"] + [r["variant"] for r in timed[:args.top] if r["variant"] != "default"]
            measured = sweep(name, rows, variants, gen, args.prequantized)
            gemv_default = [r for r in measured if r.get("kernel") == "gemv"][:1]  # GEMV_GRID's first
            print_table(fastest(measured)[:6] + [r for r in measured if r.get("variant") == "default"] + gemv_default,
                        COLUMNS)
            results += measured
        save_results({**run_metadata(), "rows": results}, "linear-sweep", args.out)


if __name__ == "__main__":
    main()
