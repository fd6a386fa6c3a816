"""Does a weight prefetched into L2 during latency-bound kernels make the next decode GEMV faster? (H200)

Each timed call replays, in one CUDA graph: a flush (a copy that pushes earlier data out of L2, as the MoE's
weights do in the model) -> optionally `dsflash::l2_prefetch_` of the GEMV's weight (some bytes, in pieces) ->
a window of latency-bound kernels (0, 1 or 2 fused mHC seams at 1 token, the model's own kernel) -> the
`dsflash::bf16_linear` GEMV at one row (the flash-40l-e8 decode projections). Gain = the call without the
prefetch minus the call with it, both in the same round; the window alone with and without the prefetch says
whether the prefetch traffic slows the latency-bound kernels. Variants take turns over `--rounds` rounds
(median of each round's CUDA-graph median).

    python scripts/sweep_prefetch.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mhc import fused, make_case  # noqa: E402  (the seam's release-shaped inputs)

from dsflash_compile.benchmarking import (copy_bandwidth, print_table, run_metadata, save_results,  # noqa: E402
                                          time_graph)
from dsflash_compile.custom_ops import l2_prefetch_triton  # noqa: E402
from dsflash_compile.custom_ops.bf16_linear import bf16_linear_reference  # noqa: E402

# (K per group, N, groups, quantize_x), as in scripts/sweep_linear.py
PROJECTIONS = {"wq_a+wkv": (5120, 1792, 1, True), "wq_b": (1280, 32768, 1, True), "wo_a": (4096, 8192, 8, False),
               "wo_b": (8192, 5120, 1, True)}
MB = 2 ** 20
COLUMNS = [("proj", "proj", ""), ("window", "window", "d"), ("MB", "mb", "d"), ("pieces", "pieces", "d"),
           ("chunk", "chunk", "d"), ("call us", "s", ".2f", 1e6), ("gain us", "gain_s", ".2f", 1e6),
           ("window us", "window_s", ".2f", 1e6), ("window+pf us", "window_pf_s", ".2f", 1e6)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(PROJECTIONS), default=list(PROJECTIONS))
    parser.add_argument("--mb", nargs="+", type=int, default=[8, 16, 24, 32, 48])
    parser.add_argument("--pieces", nargs="+", type=int, default=[1, 64, 1024])
    parser.add_argument("--windows", nargs="+", type=int, default=[0, 1, 2], help="seams before the GEMV")
    parser.add_argument("--chunks", nargs="+", type=int, default=[4096, 16384, 65536],
                        help="bytes per prefetch instruction, swept at 24 MB and 1 piece with one seam")
    parser.add_argument("--flush-mb", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_prefetch.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    flush_src = torch.randn(args.flush_mb * MB // 2, device="cuda", generator=gen).bfloat16()
    flush_dst = torch.empty_like(flush_src)
    seam = make_case(1, gen)

    variants = []
    for name in args.only:
        k, n, groups, quantize = PROJECTIONS[name]
        x = torch.randn(1, groups * k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) / 64).bfloat16()
        want = bf16_linear_reference(x, w, groups, quantize)
        got = torch.ops.dsflash.bf16_linear(x, w, groups, quantize)
        assert ((got - want).abs().max() / want.abs().max()).item() <= 2 ** -7, name
        total = w.numel() * 2
        flat = w.view(-1).view(torch.uint8)
        for window in args.windows:
            plans = [(0, 1, l2_prefetch_triton.CHUNK)]
            plans += [(mb, p, l2_prefetch_triton.CHUNK) for mb in args.mb for p in args.pieces
                      if mb * MB <= total and total % (p * 16) == 0]
            if window == 1:
                plans += [(24, 1, c) for c in args.chunks if c != l2_prefetch_triton.CHUNK and 24 * MB <= total]
            for mb, pieces, chunk in plans:
                piece = total // pieces
                take = mb * MB // pieces // 16 * 16

                def call(x=x, w=w, groups=groups, quantize=quantize, flat=flat, piece=piece, take=take,
                         pieces=pieces, chunk=chunk, window=window, gemv=True):
                    flush_dst.copy_(flush_src)
                    if take:
                        l2_prefetch_triton.l2_prefetch_triton(flat, piece, take, pieces, chunk=chunk)
                    for _ in range(window):
                        fused(seam)
                    if gemv:
                        torch.ops.dsflash.bf16_linear(x, w, groups, quantize)
                variants.append({"proj": name, "window": window, "mb": mb, "pieces": pieces, "chunk": chunk,
                                 "call": call, "times": [], "window_times": []})

    flush_alone = []
    for r in range(args.rounds):
        flush_alone.append(time_graph(lambda: flush_dst.copy_(flush_src)))
        for v in variants:
            v["times"].append(time_graph(v["call"]))
            if v["pieces"] == 1 and v["chunk"] == l2_prefetch_triton.CHUNK:
                v["window_times"].append(time_graph(lambda: v["call"](gemv=False)))
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    rows = []
    for v in variants:
        row = {key: v[key] for key in ("proj", "window", "mb", "pieces", "chunk")}
        row["s"] = statistics.median(v["times"])
        if v["window_times"]:
            row["window_alone_s"] = statistics.median(v["window_times"])
        rows.append(row)
    base = {(r["proj"], r["window"]): r for r in rows if r["mb"] == 0}
    for r in rows:
        b = base[(r["proj"], r["window"])]
        r["gain_s"] = b["s"] - r["s"]
        if "window_alone_s" in r:
            r["window_s"] = b.get("window_alone_s")
            r["window_pf_s"] = r["window_alone_s"]
    flush = statistics.median(flush_alone)
    print_table(rows, COLUMNS)
    print(f"flush alone {flush * 1e6:.2f} us; L2 {props.L2_cache_size / MB:.0f} MB")
    save_results({**run_metadata(), "copy_bandwidth": copy_bandwidth(), "l2_bytes": props.L2_cache_size,
                  "flush_s": flush, "rounds": args.rounds, "rows": rows}, "prefetch-sweep", args.out)


if __name__ == "__main__":
    main()
