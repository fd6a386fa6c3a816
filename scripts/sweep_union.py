"""Sweep the union prefill path's launch knobs of `candidate_scores` (tokens per group, union blocks per
step, programs per group) on 4096-token prefill chunks; each variant is checked against the default
launch first (same -inf pattern, scores within 0.05). Picks the defaults in custom_ops/indexer_triton.py.

    python scripts/sweep_union.py --contexts 131072 524288 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_indexer import BLOCK, make_case  # noqa: E402

from dsflash_compile.benchmarking import print_table, run_metadata, save_results, sweep_variant  # noqa: E402
from dsflash_compile.custom_ops import indexer_triton  # noqa: E402

COLUMNS = [("context", "context", "d"), ("tokens/group", "tokens_per_group", "d"), ("blocks/step", "union_blocks", "d"),
           ("parts", "parts", "d"), ("ms", "s", ".3f", 1e3), ("agrees", "agrees", "")]


def sweep(context: int, prefill: int) -> list[dict]:
    case = make_case(1, context, prefill, torch.Generator(device="cuda").manual_seed(0), 0.3)
    args = (case["q"], case["weights"], case["keys_mxfp4"], case["blocks"], BLOCK, case["visible"], "mxfp4")
    want = indexer_triton.candidate_scores_triton(*args, union=True)

    def agrees(got):
        return torch.equal(got.isfinite(), want.isfinite()) and \
            (got.float() - want.float()).nan_to_num().abs().max().item() < 0.05
    rows = []
    # the 11-30 sweep over (2, 4) x (4, 8, 16) x (1, 2, 4) found the smallest union and the most programs
    # fastest (2 x 4, 4 parts): this one goes below and above that corner
    for tokens, blocks, parts in itertools.product((1, 2, 4), (2, 4, 8), (2, 4, 8)):
        def call():
            return indexer_triton.candidate_scores_triton(*args, union=True, tokens_per_group=tokens,
                                                          union_blocks=blocks, parts=parts)
        rows.append(sweep_variant({"context": context, "tokens_per_group": tokens, "union_blocks": blocks,
                                   "parts": parts}, call, agrees, calls=2, replays=5))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 524288])
    parser.add_argument("--prefill", type=int, default=4096, help="query tokens of the chunk")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_union.py needs a CUDA device")
    rows = [row for context in args.contexts for row in sweep(context, args.prefill)]
    print_table(rows, COLUMNS)
    save_results({**run_metadata(), "rows": rows}, "union-sweep", args.out)


if __name__ == "__main__":
    main()
