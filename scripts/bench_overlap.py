"""Decode step time with the mHC overlap on vs off (issue 8), in one run, with the spread of repeated runs.

    python scripts/bench_overlap.py --preset flash-40l-e8 --batch 1 4 8 16 32 --context 4096

Three variants of the same random-weight model, each compiled (dsflash_compile.compile, our passes) and
captured as decode CUDA graphs for every batch size before any timing:
  - fused:   mhc_overlap=False, one launch per mHC seam (today's path);
  - overlap: every seam split (the cutoff set above the largest batch), the mixes forked on the side stream;
  - split:   the overlap variant's kernels captured with the side stream off (side_stream.enabled(False)):
             what the extra launch costs without the overlap.
Then `--repeats` rounds, each timing every variant at every batch size (`--steps` consecutive steps, median;
the variant order rotates per round so drift does not favour one). Per batch: median over rounds, min and
max, and fused / overlap. A profiler trace of one overlap step per batch (Chrome JSON, gzipped) shows the
forked mixes; `concurrent_us` sums the time seam kernels ran while another kernel was running (about zero
when fused). The JSON goes to --out via dsflash_compile.benchmarking; it is rewritten after each phase.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time

import torch

import dsflash_compile
from compile_and_profile import decode_step, fill_cache, profile_step, step_time
from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.benchmarking import print_table, run_metadata, save_results
from dsflash_compile.compiled import CompileOptions
from dsflash_compile.custom_ops import side_stream

VARIANTS = ("fused", "overlap", "split")


def concurrent_us(trace_path: str, name: str = "_seam_kernel") -> float:
    """Microseconds the kernels called `name` overlapped other kernels in a Chrome trace (summed over pairs)."""
    events = [e for e in json.loads(open(trace_path).read())["traceEvents"] if e.get("cat") == "kernel"]
    others = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] != name)
    total = 0.0
    for e in (e for e in events if e["name"] == name):
        start, end = e["ts"], e["ts"] + e["dur"]
        total += sum(max(0.0, min(end, b) - max(start, a)) for a, b in others if a < end and b > start)
    return total


def compile_variant(model, variant: str, batches: list[int], max_length: int, context: int, gen):
    """Compile for `variant` ("fused" or "overlap") and capture its decode graphs. Returns the runner and
    batch -> step function (a step replays the graph; the cache is rewound to `context` before it fills)."""
    torch._dynamo.reset()
    model.compiled_runner = None
    dsflash_compile.compile(model, max_batch=max(batches), max_length=max_length, batch_buckets=tuple(batches),
                            mhc_overlap=variant != "fused", mhc_overlap_max_tokens=max(batches))
    runner = model.compiled_runner
    steps = {}
    for batch in batches:  # ascending: the last fill leaves every row at `context` tokens
        ids = torch.randint(0, model.config.text_config.vocab_size, (batch, 1), device="cuda", generator=gen)
        mask = torch.ones_like(ids)
        runner.cache.reset()
        fill_cache(runner.cache, batch, context, gen)
        start = time.perf_counter()
        runner(ids, mask, 1)  # compiles the blocks and captures the decode graph
        torch.cuda.synchronize()
        print(f"{variant} batch {batch}: compile + capture {time.perf_counter() - start:.1f} s", flush=True)
        steps[batch] = decode_step(runner, ids, mask, context)
    return runner, steps


def split_variant(runner, overlap_steps: dict) -> dict:
    """The overlap runner's decode graphs captured again with the side stream off; its steps replay those."""
    overlapped, runner.graphs = runner.graphs, {}
    with side_stream.enabled(False):
        for step in overlap_steps.values():
            step()  # no graph for this batch yet: captures one
    split, runner.graphs = runner.graphs, overlapped

    def with_graphs(step):
        def run():
            runner.graphs = split
            try:
                return step()
            finally:
                runner.graphs = overlapped
        return run
    return {batch: with_graphs(step) for batch, step in overlap_steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="flash-40l-e8")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    batches = sorted(args.batch)
    try:  # before the minutes of building the model: the options compile_variant will pass
        CompileOptions(mhc_overlap=True, mhc_overlap_max_tokens=batches[-1])
    except ValueError as error:
        parser.error(f"--batch: {error}")
    name = f"overlap-{args.preset}-b{'-'.join(map(str, batches))}"

    torch.set_grad_enabled(False)
    with torch.device("cuda"):
        model = DeepseekV41ForCausalLM(preset_config(args.preset)).eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    max_length = args.context + args.steps + 64
    result = {**run_metadata(), "preset": args.preset, "context": args.context, "steps": args.steps,
              "repeats": args.repeats, "batches": {str(b): {} for b in batches}}

    steps = {}
    for variant in ("fused", "overlap"):
        runner, steps[variant] = compile_variant(model, variant, batches, max_length, args.context, gen)
        result[f"{variant}_pass_matches"] = dict(runner.pass_manager.matches)
    steps["split"] = split_variant(runner, steps["overlap"])
    save_results(result, name, args.out)

    times = {(v, b): [] for v in VARIANTS for b in batches}
    for round_ in range(args.repeats):
        order = VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]
        for batch in batches:
            for variant in order:
                times[variant, batch].append(step_time(steps[variant][batch], args.steps))
        print(f"round {round_ + 1}/{args.repeats} done", flush=True)

    rows = []
    for batch in batches:
        row = result["batches"][str(batch)]
        for variant in VARIANTS:
            runs = times[variant, batch]
            row[variant] = {"median_s": statistics.median(runs), "min_s": min(runs), "max_s": max(runs), "runs_s": runs}
        row["fused_over_overlap"] = row["fused"]["median_s"] / row["overlap"]["median_s"]
        trace = os.path.join(args.out, f"overlap-trace-{args.preset}-b{batch}.json")
        row["overlap_profile"] = profile_step(steps["overlap"][batch], trace)
        row["overlap_concurrent_us"] = concurrent_us(trace)
        with open(trace, "rb") as raw, gzip.open(trace + ".gz", "wb") as packed:  # as the other traces are kept
            packed.write(raw.read())
        os.remove(trace)
        fused_trace = os.path.join(args.out, f"fused-trace-{args.preset}-b{batch}.json")
        profile_step(steps["fused"][batch], fused_trace)
        row["fused_concurrent_us"] = concurrent_us(fused_trace)
        os.remove(fused_trace)  # only its number is kept
        rows.append({"batch": batch, **{f"{v}_us": row[v]["median_s"] * 1e6 for v in VARIANTS},
                     **{f"{v}_spread_us": (row[v]["max_s"] - row[v]["min_s"]) * 1e6 for v in VARIANTS},
                     "ratio": row["fused_over_overlap"], "concurrent_us": row["overlap_concurrent_us"]})
        save_results(result, name, args.out)
    print_table(rows, [("batch", "batch", "d"), ("fused us", "fused_us", ".0f"), ("+-", "fused_spread_us", ".0f"),
                       ("overlap us", "overlap_us", ".0f"), ("+-", "overlap_spread_us", ".0f"),
                       ("split us", "split_us", ".0f"), ("+-", "split_spread_us", ".0f"),
                       ("fused/overlap", "ratio", ".3f"), ("seam concurrent us", "concurrent_us", ".0f")])
    print("(+-: max - min over rounds; seam concurrent us: seam kernel time overlapping other kernels, one step)")


if __name__ == "__main__":
    main()
