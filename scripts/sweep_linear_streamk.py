"""Sweep the one-row stream-K kernel (custom_ops/bf16_linear_streamk_triton.py) against the tiled kernel's default
launch (bf16_linear_triton.py) and cuBLAS on flash-40l-e8's large decode projections, side by side in one run.

Each variant runs over --layers layers, each with its own weight (so the weight streams from HBM as in a decode
step, not from L2), in one CUDA graph with PDL; the time is per layer. Every variant is checked against the
reference first (2^-7 of the largest output) and the stream-K kernel for equal bits on a second call. Then the
three projections back to back per layer (wq_b, wo_a, wo_b, as a layer runs them) with each kernel's launch.

    python scripts/sweep_linear_streamk.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sweep_linear import PROJECTIONS  # noqa: E402

from dsflash_compile.benchmarking import fastest, print_table, run_metadata, save_results, time_graph  # noqa: E402
from dsflash_compile.custom_ops import bf16_linear_streamk_triton as streamk  # noqa: E402
from dsflash_compile.custom_ops import bf16_linear_triton as tiled  # noqa: E402
from dsflash_compile.custom_ops.bf16_linear import bf16_linear_reference  # noqa: E402
from dsflash_compile.layers import block_diagonal_linear  # noqa: E402
from dsflash_compile.quant import fp8_qdq  # noqa: E402

# (block_n, block_k, programs_per_sm, num_warps, num_stages)
GRID = list(itertools.product((16, 32, 64), (128, 256), (1, 2), (4,), (3, 4))) + [
    (32, 128, 1, 8, 4), (64, 128, 1, 8, 4), (32, 128, 3, 4, 3), (16, 256, 3, 4, 3)]
CHAIN = ("wq_b", "wo_a", "wo_b")


def case(name: str, layers: int, gen: torch.Generator):
    k, n, groups, quantize = PROJECTIONS[name]
    x = torch.randn(1, groups * k, device="cuda", generator=gen).bfloat16()
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / 64).bfloat16() for _ in range(layers)]
    return x, weights, groups, quantize


def per_layer(fn, x, weights, rounds: int) -> tuple[float, list]:
    times = [time_graph(lambda: [fn(x, w) for w in weights], calls=2, replays=20) / len(weights)
             for _ in range(rounds)]
    return statistics.median(times), times


def sweep(name: str, layers: int, rounds: int, gen: torch.Generator) -> list[dict]:
    x, weights, groups, quantize = case(name, layers, gen)
    want = bf16_linear_reference(x, weights[0], groups, quantize)
    scale = want.abs().max()
    ready = fp8_qdq(x) if quantize else x
    weight_bytes = weights[0].numel() * 2
    variants = {"cuBLAS": (lambda x_, w: block_diagonal_linear(ready, w, groups)),
                "tiled": (lambda x_, w: tiled.bf16_linear_triton(x_, w, groups, quantize))}
    for block_n, block_k, per_sm, warps, stages in GRID:
        if (weights[0].shape[0] // groups) % block_n:
            continue
        variants[f"stream-K {block_n}x{block_k} {per_sm}/SM {warps}w {stages}s"] = (
            lambda x_, w, o=dict(block_n=block_n, block_k=block_k, programs_per_sm=per_sm, num_warps=warps,
                                 num_stages=stages): streamk.bf16_linear_streamk(x_, w, groups, quantize, **o))
    rows = []
    for label, fn in variants.items():
        row = {"proj": name, "variant": label}
        try:
            got = fn(x, weights[0])
            row["agrees"] = ((got - want).abs().max() / scale).item() <= 2 ** -7
            row["same_bits_again"] = torch.equal(got, fn(x, weights[0]))
            row["s"], row["rounds_s"] = per_layer(fn, x, weights, rounds)
            row["tbps"] = weight_bytes / row["s"] / 1e12
        except Exception as error:  # noqa: BLE001 - e.g. out of resources: reported, the sweep goes on
            row.update(agrees=False, error=f"{type(error).__name__}: {error}"[:300])
        print(row, flush=True)
        rows.append(row)
    base = next(r["s"] for r in rows if r["variant"] == "tiled")
    for row in rows:
        if "s" in row:
            row["vs_tiled"] = base / row["s"]
    return rows


def chain(best: dict, layers: int, rounds: int, gen: torch.Generator) -> list[dict]:
    """wq_b, wo_a, wo_b a layer, each on the tiled kernel or on its fastest stream-K launch, in turns."""
    cases = {name: case(name, layers, gen) for name in CHAIN}
    calls = {"tiled": {n: (lambda x, w, g=c[2], q=c[3]: tiled.bf16_linear_triton(x, w, g, q))
                       for n, c in cases.items()},
             "stream-K": {n: (lambda x, w, g=c[2], q=c[3], o=best[n]: streamk.bf16_linear_streamk(x, w, g, q, **o))
                          for n, c in cases.items()}}

    def run(kind):
        for layer in range(layers):
            for name, (x, weights, _, _) in cases.items():
                calls[kind][name](x, weights[layer])

    times = {kind: [] for kind in calls}
    for r in range(rounds):
        for kind in list(calls)[r % 2:] + list(calls)[:r % 2]:
            times[kind].append(time_graph(lambda: run(kind), calls=1, replays=20) / layers)
    return [{"chain": "+".join(CHAIN), "variant": kind, "s": statistics.median(ts), "rounds_s": ts,
             "launches": {n: best[n] for n in CHAIN} if kind == "stream-K" else "default"}
            for kind, ts in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=CHAIN, default=list(CHAIN))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_linear_streamk.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {**run_metadata(), "layers": args.layers, "rows": [], "chain": []}
    best = {}
    for name in args.only:
        rows = sweep(name, args.layers, args.rounds, gen)
        result["rows"] += rows
        print_table(fastest(rows)[:8], [("proj", "proj", ""), ("variant", "variant", ""), ("us", "s", ".2f", 1e6),
                                        ("TB/s", "tbps", ".2f"), ("vs tiled", "vs_tiled", ".3f")])
        top = next(r for r in fastest(rows) if r["variant"].startswith("stream-K") and r["same_bits_again"])
        block, per_sm, warps, stages = top["variant"].split()[1:]
        block_n, block_k = block.split("x")
        best[name] = dict(block_n=int(block_n), block_k=int(block_k), programs_per_sm=float(per_sm.split("/")[0]),
                          num_warps=int(warps[:-1]), num_stages=int(stages[:-1]))
        save_results(result, "linear-streamk-sweep", args.out)
    if set(best) == set(CHAIN):
        result["chain"] = chain(best, args.layers, args.rounds + 2, gen)
        print_table(result["chain"], [("chain", "chain", ""), ("variant", "variant", ""), ("us / layer", "s", ".2f", 1e6)])
    save_results(result, "linear-streamk-sweep", args.out)


if __name__ == "__main__":
    main()
