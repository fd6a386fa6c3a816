"""Sweep the top-k launch (k = 512) on the shapes where the 11-30 H200 bench found topk_indices slower than
torch.topk (4096 rows x 8K..512K) and on decode shapes (64 x 128K, 64 x 512K, 8 x 512K): the filter path at the
launches of topk_triton.FILTER_VARIANTS (with how many rows overflowed into the radix fallback), the
row-wise path at its two best 11-30 launches, the radix split path, the choice select_topk makes by shape
("auto"), and torch.topk. Every variant's picks are checked against torch.topk's values first (k distinct
ids, each at least the k-th largest value). Picks the defaults of custom_ops/topk_triton.py (GROUPS,
SAMPLE, CAND, FILTER_BLOCK, FILTER_WARPS, filter_fits, rowwise_fits), and times the segmented filter path
at the segment count filter_segments would pick, half and twice it (SEGMENT, SEGMENTED_ON).

    python scripts/sweep_topk.py --out benchmarks/results
    python scripts/sweep_topk.py --shapes 64x131072 8x524288      (some shapes; the JSON is rewritten after each)
    python scripts/sweep_topk.py --single     (the single path at decode's B1 rows, 4K context, by its most warps)
"""

from __future__ import annotations

import argparse
import itertools

import torch

from dsflash_compile.benchmarking import print_table, run_metadata, save_results, sweep_variant, time_graph
from dsflash_compile.custom_ops import topk_triton

K = 512
SHAPES = [(4096, 8192), (4096, 16384), (4096, 131072), (4096, 524288), (64, 131072), (64, 524288), (8, 524288)]
# (chunk, warps): the default, and the 11-30 sweep's second best at 64 x 128K
ROWWISE = [(topk_triton.CHUNK, topk_triton.CHUNK_WARPS), (8192, 8)]
COLUMNS = [("rows", "rows", "d"), ("width", "width", "d"), ("path", "path", ""), ("groups", "groups", "d"),
           ("sample", "sample", "d"), ("cand", "cand", "d"), ("segments", "segments", "d"), ("chunk", "chunk", "d"),
           ("warps", "num_warps", "d"),
           ("ms", "s", ".3f", 1e3), ("x torch", "vs_torch", ".2f"), ("overflow", "overflow", "d"),
           ("agrees", "agrees", "")]


def sweep(rows: int, width: int) -> list[dict]:
    scores = torch.randn(rows, width, device="cuda").bfloat16()
    want = scores.float().topk(K, dim=-1).values[:, -1:]  # the k-th largest value per row
    torch_s = time_graph(lambda: scores.topk(K, dim=-1), calls=2, replays=5)

    def agrees(picks):
        # bf16 scores tie often: a right answer has k distinct ids whose values all reach the k-th largest
        picks = picks.long().sort(dim=1).values
        return bool((scores.float().gather(1, picks) >= want).all()) and bool((picks.diff(dim=1) > 0).all())
    out = [{"rows": rows, "width": width, "path": "torch.topk", "s": torch_s, "vs_torch": 1.0, "agrees": True}]
    print(out[0], flush=True)
    variants = [({"path": "auto"}, lambda: topk_triton.select_topk(scores, K)),
                ({"path": "radix"}, lambda: topk_triton.select_topk(scores, K, block=topk_triton.BLOCK))]
    variants += [({"path": "rowwise", "chunk": chunk, "num_warps": warps},
                  lambda chunk=chunk, warps=warps: topk_triton.select_rowwise(scores, K, chunk, warps))
                 for chunk, warps in ROWWISE]
    flags = torch.zeros(rows, dtype=torch.int32, device="cuda")
    for groups, sample, cand, block, warps in topk_triton.FILTER_VARIANTS:
        variants.append(({"path": "filter", "groups": groups, "sample": sample, "cand": cand, "chunk": block,
                          "num_warps": warps},
                         lambda args=(groups, sample, cand, block, warps): topk_triton.select_filtered(
                             scores, K, *args, flags=flags)))
    segments = topk_triton.filter_segments(rows, width, K, scores.device, on=True)
    for count in sorted({segments // 2, segments, 2 * segments} - {0, 1}) if segments else ():
        variants.append(({"path": "segmented", "segments": topk_triton.segment_plan(width, count)[0]},
                         lambda count=count: topk_triton.select_filtered(scores, K, flags=flags, segments=count)))
    for params, call in variants:
        row = sweep_variant({"rows": rows, "width": width, **params}, call, agrees, calls=2, replays=5)
        row["vs_torch"] = torch_s / row["s"]
        if row["path"] in ("filter", "segmented"):  # rows whose candidates overflowed into the radix fallback
            row["overflow"] = int(flags.sum())
        out.append(row)
    return out


# the single path's rows at a 4K context, batch 1: (mode, width, k): candidate_blocks' 515 block maxima (FINITE),
# topk_indices' dense row (VISIBLE), candidate_topk's 515 x 8 candidates (CANDIDATE_ROWS)
SINGLE_ROWS = [(topk_triton.FINITE, 515, 512), (topk_triton.VISIBLE, 2060, 512),
               (topk_triton.CANDIDATE_ROWS, 4120, 512)]
# the launch settings swept (topk_triton's constants), each value after the module's own
SINGLE_SETTINGS = {"SINGLE_SPLIT": [False, True], "SINGLE_RADIX": [False, True], "SINGLE_MAX_WARPS": [4, 8, 16],
                   "SINGLE_KEYS_PER_THREAD": [8, 16]}
SINGLE_COLUMNS = [("mode", "mode", "d"), ("width", "width", "d"), ("split", "SINGLE_SPLIT", ""),
                  ("radix", "SINGLE_RADIX", ""),
                  ("max warps", "SINGLE_MAX_WARPS", "d"), ("keys a thread", "SINGLE_KEYS_PER_THREAD", "d"),
                  ("warps", "num_warps", "d"), ("us", "s", ".2f", 1e6), ("agrees", "agrees", "")]


def single_launches() -> list[dict]:
    """The module's settings first, then every other combination of SINGLE_SETTINGS' values that launches
    differently (same HEAD, TAIL and warps at every SINGLE_ROWS width: timed once)."""
    default = {name: getattr(topk_triton, name) for name in SINGLE_SETTINGS}
    combos = [default] + [dict(zip(SINGLE_SETTINGS, values)) for values in itertools.product(*SINGLE_SETTINGS.values())]
    seen, out = set(), []
    for settings in combos:
        key = tuple(_launch(settings, width) for _, width, _ in SINGLE_ROWS)
        if key not in seen:
            seen.add(key)
            out.append(settings)
    return out


def _launch(settings: dict, width: int) -> tuple:
    """(HEAD, TAIL, warps, RADIX) of row_topk at `width` under `settings`."""
    saved = {name: getattr(topk_triton, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(topk_triton, name, value)
        head, tail = topk_triton.single_parts(width)
        return head, tail, topk_triton.single_warps(head), topk_triton.SINGLE_RADIX
    finally:
        for name, value in saved.items():
            setattr(topk_triton, name, value)


def sweep_single() -> list[dict]:
    """row_topk at SINGLE_ROWS under each of single_launches() (the module's first), each one's picks checked
    against the first's; the module's settings restored."""
    saved = {name: getattr(topk_triton, name) for name in SINGLE_SETTINGS}
    out = []
    for mode, width, k in SINGLE_ROWS:
        scores = torch.randn(1, width, device="cuda").bfloat16()
        visible = torch.full((1,), width - 7, device="cuda")
        blocks = torch.arange(width // 8, device="cuda", dtype=torch.int32).view(1, -1) * 3

        def call():
            return topk_triton.row_topk(scores, k, mode, visible=visible, blocks=blocks, block_size=8)
        want = None
        try:
            for settings in single_launches():
                for name, value in settings.items():
                    setattr(topk_triton, name, value)
                want = call() if want is None else want
                row = {"mode": mode.value, "width": width, **settings,
                       "num_warps": topk_triton.single_warps(topk_triton.single_parts(width)[0])}
                out.append(sweep_variant(row, call, lambda picks: torch.equal(picks, want)))
        finally:
            for name, value in saved.items():
                setattr(topk_triton, name, value)
    return out


def shape(text: str) -> tuple[int, int]:
    rows, sep, width = text.partition("x")
    if not (sep and rows.isdigit() and width.isdigit()) or int(width) < K:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not ROWSxWIDTH with WIDTH >= k = {K}")
    return int(rows), int(width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=shape, default=SHAPES, metavar="ROWSxWIDTH",
                        help="default: " + " ".join(f"{r}x{w}" for r, w in SHAPES))
    parser.add_argument("--single", action="store_true", help="the single path's launches instead (SINGLE_ROWS)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_topk.py needs a CUDA device")
    if args.single:
        measured = sweep_single()
        print_table(measured, SINGLE_COLUMNS)
        save_results({**run_metadata(), "rows": measured}, "topk-single-sweep", args.out)
        return
    results = []
    for rows, width in args.shapes:  # saved after each shape so a cut run keeps what it measured
        measured = sweep(rows, width)
        print_table(measured, COLUMNS)
        results += measured
        save_results({**run_metadata(), "rows": results}, "topk-sweep", args.out)


if __name__ == "__main__":
    main()
