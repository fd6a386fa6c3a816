"""Time to first token with SWA bounded replay off and on, and an agentic turn with and without the prefix
cache, through dsflash_compile.compile (chunked prefill, batch 1).

    python scripts/bench_prefill.py [--preset flash-40l-e8] [--lengths 1024 8192 32768 131072]
                                    [--agentic-prefix 32768] [--agentic-new 1024] [--device cuda]
    python scripts/bench_prefill.py --preset tiny --lengths 64 128 --agentic-prefix 64 --agentic-new 16 \\
        --device cpu --backend eager --repeats 1      (a quick check on the CPU)

TTFT = one prefill forward of a fresh random prompt asking for the last logits (what generate() does),
synchronized, median of --repeats after one untimed run of the same length (compiles what it needs). Replay
off runs every layer on every token; replay on runs the layers after the last KV source on the last window
of tokens only. The trimmed layers run as compiled blocks, not yet as their own CUDA graphs (issue 6 item 2),
so that variant is not here. Agentic turn: a prompt of --agentic-prefix tokens was answered before; the next
prompt extends it by --agentic-new tokens. Full recompute (replay on, no prefix cache) vs a prefix-cache hit
(the previous prompt's state restored, the last window replayed). Writes prefill-<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dsflash_compile
from dsflash_compile.benchmarking import print_table, run_metadata, save_results, sync
from dsflash_compile.presets import preset_model


@torch.inference_mode()
def ttft(model, ids: torch.Tensor, repeats: int) -> float:
    """Median seconds of a prefill of `ids` into the compiled runner's emptied cache, after one untimed run
    (repeats=0: the one run, timed)."""
    runner, times = model.compiled_runner, []
    for i in range(repeats + 1):
        cache = runner.fresh_cache(1, ids.shape[1] + 1)
        sync(ids.device)
        start = time.perf_counter()
        model(ids, cache=cache, logits_to_keep=1)
        sync(ids.device)
        if i or not repeats:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="flash-40l-e8")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--agentic-prefix", type=int, default=32768)
    parser.add_argument("--agentic-new", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (eager: a quick CPU check)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    device = torch.device(args.device)
    model = preset_model(args.preset, device)
    text = model.model.text_config
    longest = max(*args.lengths, args.agentic_prefix + args.agentic_new)
    build = time.perf_counter()
    dsflash_compile.compile(model, max_batch=1, max_length=longest + 1, batch_buckets=(1,), backend=args.backend)
    result = run_metadata()
    result.update(preset=args.preset, window=text.sliding_window, backend=args.backend, rows=[])
    gen = torch.Generator().manual_seed(1)

    def prompt(length: int) -> torch.Tensor:
        return torch.randint(3, text.vocab_size, (1, length), generator=gen).to(device)

    for length in args.lengths:
        row = {"prompt": length}
        for replay in (False, True):
            text.swa_bounded_replay = replay
            row[f"ttft_replay_{'on' if replay else 'off'}_s"] = ttft(model, prompt(length), args.repeats)
        row["ttft_reduction"] = 1 - row["ttft_replay_on_s"] / row["ttft_replay_off_s"]
        print(row, flush=True)
        result["rows"].append(row)
    result["first_compile_and_prefills_s"] = time.perf_counter() - build

    text.swa_bounded_replay = True
    before = prompt(args.agentic_prefix)
    turn = torch.cat([before, prompt(args.agentic_new)], 1)
    agentic = {"prefix": args.agentic_prefix, "new": args.agentic_new,
               "full_recompute_s": ttft(model, turn, args.repeats)}
    hits = []
    for i in range(args.repeats + 1):  # each with a new store holding only the previous prompt (first untimed)
        store = model.enable_prefix_cache(budget_bytes=1 << 36)
        with torch.inference_mode():
            model(before, cache=model.compiled_runner.fresh_cache(1, before.shape[1] + 1), logits_to_keep=1)
        seconds = ttft(model, turn, 0)
        if i:
            hits.append(seconds)
        assert store.stats.hits == 1, "the turn did not hit the previous prompt's prefix"
    model.prefix_cache = None
    agentic["prefix_cache_hit_s"] = statistics.median(hits)
    agentic["hit_tokens"] = store.stats.hit_tokens
    agentic["speedup"] = agentic["full_recompute_s"] / agentic["prefix_cache_hit_s"]
    print(agentic, flush=True)
    result["agentic_turn"] = agentic

    print()
    print_table(result["rows"], [("prompt", "prompt", "d"), ("replay off s", "ttft_replay_off_s", ".4f"),
                                 ("replay on s", "ttft_replay_on_s", ".4f"), ("reduction %", "ttft_reduction", ".1f", 100)])
    print(f"agentic turn ({args.agentic_prefix} cached + {args.agentic_new} new): full {agentic['full_recompute_s']:.4f} s, "
          f"prefix-cache hit {agentic['prefix_cache_hit_s']:.4f} s ({agentic['speedup']:.1f}x)")
    save_results(result, "prefill", args.out)


if __name__ == "__main__":
    main()
