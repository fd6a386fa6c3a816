"""Sweep `dsflash::attention_`'s decode launch (custom_ops/attention_triton.py) at the release's decode shape:
one query token per row (64 heads x 512), 128 FP8 window keys and the top-512 NVFP4 compressed rows of a 4K
context, the split and merge kernels together. Variants: heads per program (head_group), keys per block, key
splits (default: one program per SM) and warps; then, at the default launch, the merge's heads per program
(`--merge-only`: just those). Each is checked against the reference first (5% of the largest
output, as bench_attention.py), then timed as CUDA-graph replays.

    python scripts/sweep_attention.py --batch 1 8 --out benchmarks/results
    python scripts/sweep_attention.py --batch 1 64 --merge-only
"""

from __future__ import annotations

import argparse
import itertools

import torch
from bench_attention import make_case, run_reference, run_triton

from dsflash_compile.benchmarking import print_table, run_metadata, save_results, sweep_variant

# (head_group, block_n, splits (None: the default), warps)
VARIANTS = ([(64, None, None, 8)] + list(itertools.product((16, 32, 64), (16, 32, 64), (None,), (4, 8)))
            + list(itertools.product((64,), (32, 64), (1, 4, 8), (8,))))  # key splits beyond one program per SM
MERGE_HEADS = [None, 1, 2, 4, 8, 16]  # heads per merge program (None: merge_heads' choice) at the default launch
COLUMNS = [("B", "batch", "d"), ("heads/prog", "head_group", ""), ("block_n", "block_n", ""),
           ("splits", "num_splits", ""), ("warps", "num_warps", ""), ("heads/merge", "heads_per_merge", ""),
           ("us", "s", ".2f", 1e6), ("agrees", "agrees", "")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--merge-only", action="store_true", help="only the merge's heads per program")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_attention.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for batch in args.batch:
        case = make_case(batch, args.context, 1, "nvfp4", gen)
        want = torch.empty_like(case["q"])
        run_reference(case, want)
        scale = want.float().abs().max()
        out = torch.empty_like(want)

        def agrees(_):
            return ((out.float() - want.float()).abs().max() / scale).item() <= 0.05

        rows = []
        launches = [] if args.merge_only else [dict(head_group=h, block_n=b, num_splits=s, num_warps=w)
                                               for h, b, s, w in VARIANTS]
        for cfg in launches + [dict(heads_per_merge=m) for m in MERGE_HEADS]:
            row = {"batch": batch, **cfg}
            try:
                rows.append(sweep_variant(row, lambda: run_triton(case, out, **cfg), agrees))
            except Exception as error:  # noqa: BLE001 - e.g. out of resources: reported, the sweep goes on
                rows.append({**row, "agrees": False, "error": f"{type(error).__name__}: {error}"[:300]})
                print(rows[-1], flush=True)
        print_table(sorted((r for r in rows if "s" in r), key=lambda r: r["s"])[:10] + rows[:1], COLUMNS)
        results += rows
        save_results({**run_metadata(), "context": args.context, "rows": results}, "attention-sweep", args.out)


if __name__ == "__main__":
    main()
