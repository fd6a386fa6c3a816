"""Does reading a GEMV's weight into L2 while latency-bound kernels run pay, and does PDL close launch gaps?

    python scripts/sweep_prefetch.py --out benchmarks/results

In one CUDA graph per case, `--layers` distinct weights of a decode projection (so L2 keeps none of them from
one layer to the next), each layer: a one-program kernel that spins `--spin-us` (standing for a seam, the
router or attention), then `dsflash::bf16_linear`'s kernel at one row. Cases:
- base: spin, GEMV;
- sep-<MB>: prefetch_triton.prefetch_l2 of the weight's first MB, then spin, GEMV;
- pdl: the spin lets dependents launch at once; the GEMV launches with PDL and waits before reading x;
- pdl-prefetch: as pdl, each GEMV program asking L2 for its own weight slice before the wait;
- chain, chain-pdl, chain-pdl-prefetch: GEMVs back to back (no spin), plain or with PDL.
Prints and writes us per layer; every GEMV output is checked against the plain launch's bits.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from dsflash_compile.benchmarking import run_metadata
from dsflash_compile.custom_ops.bf16_linear_triton import bf16_linear_triton
from dsflash_compile.custom_ops.prefetch_triton import prefetch_l2

SHAPES = {"wq_b": (32768, 1280), "wo_b": (5120, 8192), "wq_a+wkv": (1792, 5120)}  # (N, K) of the release


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(out_ptr, ns, TRIGGER: tl.constexpr):
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    start = _now()
    now = start
    while now - start < ns:
        now = _now()
    tl.store(out_ptr, (now - start).to(tl.int32))


def graph_us(fn, replays: int) -> float:
    """us per replay of fn captured as one CUDA graph."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--spin-us", type=float, nargs="+", default=[5.0, 10.0])
    parser.add_argument("--prefetch-mb", type=float, nargs="+", default=[8, 16, 32])
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--out")
    args = parser.parse_args()
    dev = torch.device("cuda")
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    rows = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(args.layers)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        want = [bf16_linear_triton(x, w, 1, False) for w in weights]

        def gemvs(**launch):
            outs = [bf16_linear_triton(x, w, 1, False, **launch) for w in weights]
            assert all(torch.equal(o, w) for o, w in zip(outs, want)), f"{shape} {launch}: bits differ"

        def layers(spin_ns, trigger=False, mb=0.0, **launch):
            def run():
                for w in weights:
                    if mb:
                        prefetch_l2(w, int(mb * 2 ** 20))
                    if spin_ns:
                        _spin_kernel[(1,)](flag, spin_ns, TRIGGER=trigger, num_warps=1)
                    bf16_linear_triton(x, w, 1, False, **launch)
            return run

        for launch in ({}, {"pdl": True}, {"pdl": True, "prefetch": True}):
            gemvs(**launch)
        cases = {"chain": layers(0), "chain-pdl": layers(0, pdl=True),
                 "chain-pdl-prefetch": layers(0, pdl=True, prefetch=True)}
        for spin in args.spin_us:
            ns = int(spin * 1e3)
            cases[f"spin{spin:g}-only"] = lambda ns=ns: [_spin_kernel[(1,)](flag, ns, TRIGGER=False, num_warps=1)
                                                        for _ in weights]
            cases[f"spin{spin:g}-base"] = layers(ns)
            for mb in args.prefetch_mb:
                cases[f"spin{spin:g}-sep-{mb:g}"] = layers(ns, mb=mb)
            cases[f"spin{spin:g}-pdl"] = layers(ns, trigger=True, pdl=True)
            cases[f"spin{spin:g}-pdl-prefetch"] = layers(ns, trigger=True, pdl=True, prefetch=True)
        for name, fn in cases.items():
            us = graph_us(fn, args.replays) / args.layers
            rows.append({"shape": shape, "case": name, "us_per_layer": us})
            print(f"{shape:10s} {name:24s} {us:8.2f} us/layer", flush=True)
        del weights
    if args.out:
        path = f"{args.out}/prefetch-sweep.json"
        with open(path, "w") as f:
            json.dump({**run_metadata(), "args": vars(args), "rows": rows}, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
