"""Time to first token with SWA bounded replay off and on, and an agentic turn with and without the prefix
cache, through dsflash_compile.compile (chunked prefill, batch 1).

    python scripts/bench_prefill.py [--preset flash-40l-e8] [--lengths 1024 8192 32768 131072]
                                    [--agentic-prefix 32768] [--agentic-new 1024] [--device cuda]
    python scripts/bench_prefill.py --preset tiny --lengths 64 128 --agentic-prefix 64 --agentic-new 16 \\
        --device cpu --backend eager --repeats 1      (a quick check on the CPU)

TTFT = one prefill forward of a fresh random prompt asking for the last logits (what generate() does),
synchronized. The variants of a length take turns, round by round: one untimed round (compiles what they
need), then --repeats timed rounds; each variant's median is reported with its spread (min, max), so a
slower stretch of the machine hits every variant alike instead of one of them.
Three variants per length: replay off (every layer on every token); replay on with every compiled block
launched one by one (no CUDA graphs); replay on with the runner's CUDA graphs (the default on CUDA: the
trimmed layers, after the last KV source on the last window of tokens, as one graph, and whole prefill chunks
of up to CompileOptions.prefill_graph_tokens tokens, replay off's too, as one graph each). The two replay-on variants
must give the same logits bit for bit (checked, `graphs_equal`). Agentic turn: a prompt of --agentic-prefix tokens was answered before; the next
prompt extends it by --agentic-new tokens. Full recompute (replay on, no prefix cache) vs a prefix-cache hit
(the previous prompt's state restored, the last window replayed). Writes prefill-<date>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

import dsflash_compile
from dsflash_compile.benchmarking import assignment, print_table, profile_summary, run_metadata, save_results, sync
from dsflash_compile.presets import preset_model


@torch.inference_mode()
def prefill(model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Seconds of a prefill of `ids` into the compiled runner's emptied cache, and its last logits."""
    cache = model.compiled_runner.fresh_cache(1, ids.shape[1] + 1)
    sync(ids.device)
    start = time.perf_counter()
    logits = model(ids, cache=cache, logits_to_keep=1).logits
    sync(ids.device)
    return time.perf_counter() - start, logits


def rounds(variants: dict, repeats: int, optional: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """({name: timed seconds}, {name: error}) of variants {name: callable returning seconds} run in turn: one
    untimed round, then `repeats` timed ones (repeats=0: the one round, timed). An `optional` variant that
    raises RuntimeError in the untimed round (a graph capture) is dropped and the others go on; any other
    failure raises."""
    times, errors = {name: [] for name in variants}, {}
    for i in range(repeats + 1):
        for name, run in variants.items():
            if name in errors:
                continue
            try:
                seconds = run()
            except RuntimeError as error:
                if i or name not in optional:
                    raise
                print(f"{name} failed:", repr(error), flush=True)
                errors[name] = repr(error)
                del times[name]
                continue
            if i or not repeats:
                times[name].append(seconds)
    return times, errors


def summarize(row: dict, key: str, seconds: list[float]) -> None:
    """row[key] = the median; row[key without _s + _spread_s] = [min, max]."""
    row[key] = statistics.median(seconds)
    row[key[:-2] + "_spread_s"] = [min(seconds), max(seconds)]


def spread(row: dict) -> float:
    """The widest (max - min) / median of a row's variants."""
    return max((row[key][1] - row[key][0]) / row[key.replace("_spread", "")] for key in row
               if key.endswith("_spread_s"))


def compile_options(pairs: list[tuple[str, bool | int]]) -> dict:
    """{field: value} of --option pairs: CompileOptions bool and int fields, each given a value of its type."""
    # the bool and int fields (annotations are strings here), less those the script sets itself
    fields = {f.name: f.type for f in dataclasses.fields(dsflash_compile.CompileOptions)
              if f.type in ("bool", "int") and f.name not in ("max_batch", "max_length", "dynamic_shapes")}
    for name, value in pairs:
        if name not in fields:
            raise SystemExit(f"--option {name}: not one of the CompileOptions fields this script lets you set: "
                             f"{', '.join(sorted(fields))}")
        if (fields[name] == "bool") != isinstance(value, bool):
            raise SystemExit(f"--option {name}={value}: CompileOptions.{name} is {fields[name]}")
    return dict(pairs)


COLUMNS = [("prompt", "prompt", "d"), ("replay off s", "ttft_replay_off_s", ".4f"),
           ("on, blocks s", "ttft_replay_on_blocks_s", ".4f"), ("on, graphs s", "ttft_replay_on_graphs_s", ".4f"),
           ("reduction %", "ttft_reduction", ".1f", 100), ("graphs x", "graphs_vs_blocks", ".2f"),
           ("graphs equal", "graphs_equal", ""), ("spread %", "spread", ".1f", 100)]


def print_rows(rows: list[dict]) -> None:
    print()
    print_table(rows, COLUMNS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="flash-40l-e8")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--agentic-prefix", type=int, default=32768)
    parser.add_argument("--agentic-new", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (eager: a quick CPU check)")
    parser.add_argument("--dynamic-shapes", action="store_true",
                        help="CompileOptions.dynamic_shapes: one symbolic graph per role for the prefill lengths")
    parser.add_argument("--no-agentic", action="store_true", help="time the prompt lengths only")
    parser.add_argument("--profile", type=int, nargs="*", default=[],
                        help="prompt lengths (of --lengths) whose prefill is also profiled, each variant: kernels, "
                             "kernel vs wall time, top kernels, a Chrome trace per variant next to the JSON")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", type=assignment,
                        help="a CompileOptions field for compile() (true/false or an integer), e.g. "
                             "compile_engram=true; repeatable")
    parser.add_argument("--name", default="prefill", help="results file: <out>/<name>-<date>.json")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    options = compile_options(args.option)  # before the minutes of building the model

    device = torch.device(args.device)
    model = preset_model(args.preset, device)
    text = model.model.text_config
    longest = max(*args.lengths, args.agentic_prefix + args.agentic_new)
    build = time.perf_counter()
    dsflash_compile.compile(model, max_batch=1, max_length=longest + 1, batch_buckets=(1,), backend=args.backend,
                            dynamic_shapes=args.dynamic_shapes, **options)
    result = run_metadata()
    result.update(preset=args.preset, window=text.sliding_window, backend=args.backend,
                  dynamic_shapes=args.dynamic_shapes, options=options, rows=[])
    gen = torch.Generator().manual_seed(1)

    def prompt(length: int) -> torch.Tensor:
        return torch.randint(3, text.vocab_size, (1, length), generator=gen).to(device)

    runner = model.compiled_runner
    graphs = runner.cuda_graphs  # False off CUDA: then the graph variant is not timed
    # (bounded replay, the runner's CUDA graphs); without graphs every compiled block is launched one by one
    settings = {"off": (False, graphs), "on_blocks": (True, False)} | ({"on_graphs": (True, True)} if graphs else {})

    def use(name: str) -> None:
        text.swa_bounded_replay, runner.cuda_graphs = settings[name]

    for length in args.lengths:
        row, ids, logits = {"prompt": length}, prompt(length), {}

        def variant(name: str):
            def run() -> float:
                use(name)
                seconds, logits[name] = prefill(model, ids)
                return seconds
            return run

        times, errors = rounds({name: variant(name) for name in settings}, args.repeats, optional=("on_graphs",))
        if errors:  # the other lengths go on without the graphs
            row["graphs_error"] = errors["on_graphs"]
            settings.pop("on_graphs")
            graphs = False
            settings["off"] = (False, False)
        for name, seconds in times.items():
            summarize(row, f"ttft_replay_{name}_s", seconds)
        best = row.get("ttft_replay_on_graphs_s", row["ttft_replay_on_blocks_s"])
        row["ttft_reduction"] = 1 - best / row["ttft_replay_off_s"]
        row["spread"] = spread(row)
        if graphs:
            row["graphs_equal"] = torch.equal(logits["on_blocks"], logits["on_graphs"])
            row["graphs_vs_blocks"] = row["ttft_replay_on_blocks_s"] / row["ttft_replay_on_graphs_s"]
        if length in args.profile:
            row["profile"] = {}
            Path(args.out).mkdir(parents=True, exist_ok=True)  # the profiler drops a trace quietly otherwise
            for name in settings:
                trace = str(Path(args.out) / f"prefill-trace-{length}-{name}.json")
                use(name)
                row["profile"][name] = profile_summary(lambda: prefill(model, ids), trace, top=15)
        runner.cuda_graphs = graphs
        print(row, flush=True)
        result["rows"].append(row)
        save_results(result, args.name, args.out)  # after every length: a run cut short keeps what it measured
    result["first_compile_and_prefills_s"] = time.perf_counter() - build
    if args.no_agentic:
        print_rows(result["rows"])
        save_results(result, args.name, args.out)
        return

    text.swa_bounded_replay = True
    before = prompt(args.agentic_prefix)
    turn = torch.cat([before, prompt(args.agentic_new)], 1)
    agentic = {"prefix": args.agentic_prefix, "new": args.agentic_new}
    stats = {}

    def full_recompute() -> float:
        model.prefix_cache = None
        return prefill(model, turn)[0]

    def prefix_cache_hit() -> float:  # a new store holding only the previous prompt
        store = model.enable_prefix_cache(budget_bytes=1 << 36)
        prefill(model, before)
        seconds = prefill(model, turn)[0]
        assert store.stats.hits == 1, "the turn did not hit the previous prompt's prefix"
        stats["hit_tokens"] = store.stats.hit_tokens
        return seconds

    for name, seconds in rounds({"full_recompute": full_recompute, "prefix_cache_hit": prefix_cache_hit},
                                args.repeats)[0].items():
        summarize(agentic, f"{name}_s", seconds)
    model.prefix_cache = None
    agentic["hit_tokens"] = stats["hit_tokens"]
    agentic["speedup"] = agentic["full_recompute_s"] / agentic["prefix_cache_hit_s"]
    print(agentic, flush=True)
    result["agentic_turn"] = agentic

    print_rows(result["rows"])
    print(f"agentic turn ({args.agentic_prefix} cached + {args.agentic_new} new): full {agentic['full_recompute_s']:.4f} s, "
          f"prefix-cache hit {agentic['prefix_cache_hit_s']:.4f} s ({agentic['speedup']:.1f}x)")
    save_results(result, args.name, args.out)


if __name__ == "__main__":
    main()
