"""Sweep `dsflash::l2_prefetch` (custom_ops/l2_prefetch.py) in front of the flash-40l-e8 bf16 decode projections:
how much of a projection's time a prefetch of its weight's first bytes saves, by the time the GPU spends on
other work between the two (the window) and by the bytes prefetched.

Each point is one CUDA graph replayed `--replays` times: L2 flushed (a 256 MB buffer zeroed), then the prefetch
(or not), a sleep kernel of `window` us (torch.cuda._sleep, calibrated first), then one row's projection
(dsflash::bf16_gemv, as the compiled model runs it at decode batch 1). A point's time is the graph's minus the
same graph's without the projection; the saving is the no-prefetch time minus it, side by side in one run.

    python scripts/sweep_prefetch.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sweep_linear import PROJECTIONS  # noqa: E402

from dsflash_compile.benchmarking import print_table, run_metadata, save_results, time_graph  # noqa: E402

MIB = 1 << 20
WINDOWS_US = (0, 4, 8, 12)
BUDGETS_MIB = (8, 16, 24, 32, 48)


def sleep_cycles_per_us(replays: int) -> float:
    cycles = 200_000
    return cycles / (time_graph(lambda: torch.cuda._sleep(cycles), calls=1, replays=replays) * 1e6)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=["wq_a+wkv", "wo_a", "wq_b"], choices=sorted(PROJECTIONS))
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    ops = torch.ops.dsflash
    flush = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    anchor = torch.zeros(1, device="cuda")
    per_us = sleep_cycles_per_us(args.replays)
    result = {**run_metadata(), "sleep_cycles_per_us": per_us, "rows": []}
    for name in args.only:
        k, n, groups, quantize_x = PROJECTIONS[name]
        weight = torch.randn(n, k, device="cuda").bfloat16() / k ** 0.5
        x = torch.randn(1, groups * k, device="cuda").bfloat16()
        size = weight.numel() * 2
        for window in WINDOWS_US:
            def point(budget, project=True):
                def run():
                    flush.zero_()
                    if budget:
                        ops.l2_prefetch(anchor, weight, min(budget, size), True)
                    if window:
                        torch.cuda._sleep(int(window * per_us))
                    if project:
                        ops.bf16_gemv(x, weight, groups, quantize_x)
                return time_graph(run, calls=1, replays=args.replays)

            base = point(0, project=False)
            cold = point(0) - base
            for budget in [0] + [b * MIB for b in BUDGETS_MIB if b * MIB < size + 8 * MIB]:
                s = cold if budget == 0 else point(budget) - point(budget, project=False)
                row = dict(projection=name, weight_mb=size / 1e6, window_us=window, prefetch_mb=min(budget, size) / 1e6,
                           s=s, saved_us=(cold - s) * 1e6, tb_s=size / s / 1e12)
                result["rows"].append(row)
                print(row, flush=True)
    print_table(result["rows"], [("projection", "projection", ""), ("MB", "weight_mb", ".1f"),
                                 ("window us", "window_us", ".0f"), ("prefetch MB", "prefetch_mb", ".1f"),
                                 ("us", "s", ".2f", 1e6), ("saved us", "saved_us", ".2f"), ("TB/s", "tb_s", ".2f")])
    save_results(result, "prefetch-sweep", args.out)


if __name__ == "__main__":
    main()
