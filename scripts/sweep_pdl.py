"""What programmatic dependent launch (custom_ops/pdl.py) saves between decode kernels in a CUDA graph.

    python scripts/sweep_pdl.py --out benchmarks/results

In one CUDA graph per case, `--layers` distinct weights of a decode projection (so L2 keeps none of them from
one layer to the next), each layer: a one-program kernel that spins `--spin-us` (standing for a seam, the
router or attention), then `dsflash::bf16_linear`'s kernel at one row. Cases:
- spin<us>-base: spin, GEMV, launched plainly;
- spin<us>-pdl: the spin releases its dependents at once; the GEMV launches with PDL (waits before reading x);
- chain, chain-pdl: the GEMVs back to back, plainly or with PDL;
- spin<us>-only: the spins alone.
Prints and writes us per layer; every GEMV output is checked against the plain launch's bits.

H200, 12-02 p (prefetch-sweep-2026-12-02-p.json, with an L2-prefetch experiment since dropped: a kernel asking
L2 for the next weight with cp.async.bulk.prefetch.L2, alone or in the GEMV before its PDL wait, cost 2-10 us
a layer and saved nothing): PDL after a 5 or 10 us spin saved 1.0-1.2 us a layer on wq_b, wo_b and wq_a+wkv;
back-to-back GEMVs 0.4-0.8 us, except wo_b: +4.5 us with each GEMV releasing the next at its start, +1.8 us
releasing it after its main loop (pdl-sweep-2026-12-02-p.json). The model did not gain (custom_ops/pdl.py).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from dsflash_compile.benchmarking import run_metadata
from dsflash_compile.custom_ops import pdl
from dsflash_compile.custom_ops.bf16_linear_triton import bf16_linear_triton

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

        def layers(spin_ns, with_pdl):
            def run():
                pdl.set_enabled(with_pdl)
                outs = []
                for w in weights:
                    if spin_ns:
                        _spin_kernel[(1,)](flag, spin_ns, TRIGGER=with_pdl, num_warps=1)
                    outs.append(bf16_linear_triton(x, w, 1, False))
                pdl.set_enabled(False)
                return outs
            return run

        want, got = layers(0, False)(), layers(0, True)()
        assert all(torch.equal(o, w) for o, w in zip(got, want)), f"{shape}: PDL launches give other bits"
        cases = {"chain": layers(0, False), "chain-pdl": layers(0, True)}
        for spin in args.spin_us:
            ns = int(spin * 1e3)
            cases[f"spin{spin:g}-only"] = lambda ns=ns: [_spin_kernel[(1,)](flag, ns, TRIGGER=False, num_warps=1)
                                                        for _ in weights]
            cases[f"spin{spin:g}-base"] = layers(ns, False)
            cases[f"spin{spin:g}-pdl"] = layers(ns, True)
        for name, fn in cases.items():
            us = graph_us(fn, args.replays) / args.layers
            rows.append({"shape": shape, "case": name, "us_per_layer": us})
            print(f"{shape:10s} {name:24s} {us:8.2f} us/layer", flush=True)
        del weights
    if args.out:
        path = f"{args.out}/pdl-sweep.json"
        with open(path, "w") as f:
            json.dump({**run_metadata(), "args": vars(args), "rows": rows}, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
