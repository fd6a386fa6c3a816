"""How fast can a one-row GEMV stream a bf16 weight from HBM on this GPU, by load mechanism, side by side in one run.

The decode floors (compile_and_profile.py) divide bytes by a device copy's read + write bandwidth (~4.2 TB/s on the
H200), and our Triton kernels, which load through cp.async, reach ~4.0 (the routed experts' up kernel) where
cuBLAS's lm_head GEMV (TMA, 12 stages) streams 1.3 GB at ~4.4 (12-04 b1 trace). This probe times, at the decode
shapes (the MoE's stacked w1 / w3 and w2 of 7 experts, wq_b, wo_b, wo_a, wq_a+wkv): the copy, cuBLAS,
bf16_linear_triton.py's one-row kernel, bf16_gemv's whole-tile kernel where it fits, and bf16_linear_tma_triton.py's
kernel (weight tiles by TMA, `num_stages` in flight a program) at TMA_GRID's launches, each checked against
F.linear first. (The 12-04 b3 / b5 figures came from this script's own copy of that kernel, written before the
op's: the same loads, x not FP8-rounded, as here.)

    python scripts/probe_read_bandwidth.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from dsflash_compile.benchmarking import copy_bandwidth, print_table, run_metadata, save_results, sweep_variant
from dsflash_compile.custom_ops import bf16_linear_gemv_triton as whole_tile
from dsflash_compile.custom_ops import bf16_linear_tma_triton as tma
from dsflash_compile.custom_ops import bf16_linear_triton as tiled

# (N, K); wo_a as its bytes (block-diagonal in the model: 8 groups of [1024, 4096])
SHAPES = {"moe_up (7 x w1+w3)": (32256, 5120), "moe_down (7 x w2)": (35840, 2304), "wq_b": (32768, 1280),
          "wo_b": (5120, 8192), "wo_a": (8192, 4096), "wq_a+wkv": (1792, 5120)}
# (block_n, block_k, num_stages, num_warps)
TMA_GRID = list(itertools.product((16, 32, 64, 128), (128, 256), (3, 5, 6, 7), (4,)))


def probe(name: str, n: int, k: int, gen: torch.Generator) -> list[dict]:
    # weights taken in turn, at least 128 MB of them, so that none is served from L2 (50 MB)
    copies = max(2, -(-(128 << 20) // (n * k * 2)))
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / 64).bfloat16() for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    want = F.linear(x, weights[0]).float().view(-1)
    variants = {"cuBLAS": lambda w: F.linear(x, w),
                "triton cp.async (bf16_linear default)": lambda w: tiled.bf16_linear_triton(x, w, 1, False)}
    if whole_tile.fits(x, weights[0], 1):
        variants["triton whole tile (bf16_gemv)"] = lambda w: whole_tile.bf16_linear_gemv(x, w, 1, False,
                                                                                        at_once=False)
        variants["triton whole tile at once"] = lambda w: whole_tile.bf16_linear_gemv(x, w, 1, False, at_once=True)
    for block_n, block_k, stages, warps in TMA_GRID:
        variants[f"triton TMA {block_n}x{block_k} {stages}s {warps}w"] = (
            lambda w, o=dict(block_n=block_n, block_k=block_k, num_stages=stages, num_warps=warps):
            tma.bf16_linear_tma(x, w, 1, False, **o))

    def agrees(outs):  # the first weight's
        return ((outs[0].float().view(-1) - want).abs().max() / want.abs().max()).item() <= 2 ** -7

    rows = []
    for label, fn in variants.items():
        row = {"shape": name, "n": n, "k": k, "variant": label}
        try:  # every weight a call: per weight its share of the time
            sweep_variant(row, lambda: [fn(w) for w in weights], agrees, calls=2, replays=10)
            per_weight = row["s"] / copies
            row.update(s=per_weight, tbps=n * k * 2 / per_weight / 1e12)
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: reported, the probe goes on
            row.update(agrees=False, error=f"{type(error).__name__}: {error}"[:300])
            print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_read_bandwidth.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {**run_metadata(), "copy_read_write_tbps": copy_bandwidth() / 1e12, "rows": []}
    print(f"copy (read + write): {result['copy_read_write_tbps']:.2f} TB/s", flush=True)
    for name in args.only:
        rows = probe(name, *SHAPES[name], gen)
        result["rows"] += rows
        ranked = sorted((r for r in rows if r.get("agrees")), key=lambda r: r["s"])
        print_table(ranked[:6] + [r for r in rows if not r["variant"].startswith("triton TMA")],
                    [("shape", "shape", ""), ("variant", "variant", ""), ("us", "s", ".2f", 1e6),
                     ("TB/s", "tbps", ".2f")])
        save_results(result, "read-bandwidth-probe", args.out)


if __name__ == "__main__":
    main()
