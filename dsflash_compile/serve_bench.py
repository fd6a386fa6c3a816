"""`dsflash bench serve`: the latency-throughput curve on the agentic workload (issue 7; BENCHMARKS.md),
day-zero and optimized in one run, on the same random weights.

Batching: FIXED BATCHES IN LOCKSTEP. generate() cannot take a request into a running batch, so at
concurrency C the first C sessions of the workload run together, turn by turn: each turn is one batched
`model.generate()` of their prompts, left-padded, a session's prompt being its previous prompt + its answer
+ the turn's new text. A batch runs min(--turns, its shortest session's turns) turns, so every call has C
rows. max_new_tokens of a call is the longest planned answer in the batch (capped by --max-new-tokens); each
request counts only its own planned length: its later tokens are computed (a fixed batch runs to its
longest answer) but neither timed nor counted, as a server would have answered that request already.

Timing (per request): a logits processor stamps each generated step (synchronized on CUDA). TTFT = the
generate() call's start to its first step (prefill, prefix-cache restore and host work included); TPOT =
(step n - step 1) / (n - 1) for a request of n tokens (none for n = 1); tokens/s per user = 1 / TPOT. Per
concurrency: generated tokens (counted as above) / the generate() calls' wall time = tokens/s per GPU (one
GPU). Medians and p90 of each.

Configurations:
  day-zero   the eager model, every dsflash op on its reference (custom_ops.dispatch.reference_kernels),
             the reference MoE loop, bf16 cache records, SWA bounded replay off, no prefix cache.
  optimized  dsflash_compile.compile (our passes, Inductor, decode as CUDA graphs; Triton ops on CUDA), the
             cache's release formats (FP8 / NVFP4 / MXFP4 on CUDA), bounded replay on, the prefix cache.
             Its graphs are compiled before timing (warm_up for every batch bucket); the prefix cache starts
             fresh at each concurrency holding only the shared system prefix, as a server that served other
             sessions before would.
Day-zero runs first on the freshly built model (after one untimed generate()), which is then compiled in
place: the same weights.

Where the time goes: at the --profile concurrencies (default the lowest and highest) the batch's first turn
runs once more under torch.profiler (for the optimized configuration a prefix-cache hit, as its timed later
turns are); the point keeps the kernel count, their device time and the top 10 kernels. --profile-configs
picks the configurations profiled (default optimized: a day-zero turn of flash-40l-e8 launches ~440K kernels
and takes minutes under the profiler).

Split runs: --resume takes an earlier run's configurations (same preset, device, workload, cache length, turns
and answer cap, checked) into this one, which runs --configs; e.g. day-zero in one process and optimized (its
compile takes minutes on flash-40l-e8) in another, within a per-command time limit. Each configuration keeps
its own run metadata (commit, date, command).

Headlines: TTFT and TPOT at the lowest concurrency, day-zero / optimized (x faster); throughput at a fixed
speed per user, optimized / day-zero. That speed is the median of day-zero's per-user speeds (p50 per
concurrency); each curve's throughput there is the highest it reaches while every point on it (straight
lines between measured concurrencies) gives users at least that speed. When that is the last measured
point the value is a lower bound (more concurrency might give more), flagged in the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from fractions import Fraction
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from .agentic_workload import WorkloadConfig, make_workload, workload_stats
from .benchmarking import percentiles, print_table, profile_summary, run_metadata, save_results, sync
from .compiled import compile as compile_model
from .custom_ops.dispatch import reference_kernels
from .modeling_deepseek_v41 import CACHE_KWARG
from .presets import PRESETS, preset_model

CONFIGS = ("day-zero", "optimized")
BATCHING = ("fixed batches in lockstep: at concurrency C the first C sessions run turn by turn together, one "
            "generate() per turn; max_new_tokens = the batch's longest planned answer, each request counted and "
            "timed up to its own length")
BF16_RECORDS = {"window_format": "bf16", "compressed_format": "bf16", "index_format": "bf16"}


def _scale(text: str) -> float:
    return float(Fraction(text))  # "1/128" or "0.0078125"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=[p for p in PRESETS if p != "release"], default="tiny",
                        help="random-weight preset (default: tiny)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda when available, else cpu")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                        help="sessions per fixed batch, one curve point each (default: 1 2 4 8 16 32 64)")
    parser.add_argument("--sessions", type=int, help="sessions in the workload (default: the largest concurrency)")
    parser.add_argument("--turns", type=int, default=3, help="turns per session at most (default: 3)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="cap on each answer's planned length (default: 16)")
    parser.add_argument("--scale", type=_scale, default=1 / 64,
                        help="workload lengths x this, e.g. 1/128 (default: 1/64); unscaled it is AgentX-sized")
    parser.add_argument("--max-length", type=int, help="cache length; turns that do not fit are not run "
                        "(default: what the longest turn needs)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="default: both")
    parser.add_argument("--batch-buckets", type=int, nargs="+",
                        help="optimized: compiled batch sizes (default: the concurrencies; fewer compile faster, a "
                             "concurrency then runs padded to the next bucket)")
    parser.add_argument("--prefill-buckets", type=int, nargs="+",
                        help="optimized: compiled prefill chunk lengths (default: CompileOptions'); fewer compile faster")
    parser.add_argument("--backend", default="inductor", help="optimized: torch.compile backend (eager: CPU checks)")
    parser.add_argument("--dynamic-shapes", action="store_true",
                        help="optimized: CompileOptions.dynamic_shapes (one symbolic graph per role from the second "
                             "batch bucket on: about half the compile time)")
    parser.add_argument("--prefix-cache-gb", type=float, default=8.0, help="optimized: prefix-cache budget (default: 8)")
    parser.add_argument("--profile", type=int, nargs="*",
                        help="concurrencies whose first turn is run once more under torch.profiler, for where the "
                             "time goes (default: the lowest and the highest; none with an empty list)")
    parser.add_argument("--profile-configs", nargs="+", choices=CONFIGS, default=["optimized"],
                        help="configurations profiled at those concurrencies (default: optimized; a day-zero turn "
                             "launches ~440K kernels on flash-40l-e8 and takes minutes under the profiler)")
    parser.add_argument("--resume", help="an earlier run's JSON on the same workload: its configurations are kept "
                                         "and --configs run now (day-zero and optimized in separate processes)")
    parser.add_argument("--seed", type=int, default=0, help="weights and workload (default: 0)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for serve-<preset>-<date>.json and .png")


def check_arguments(args) -> None:
    """Raise ValueError naming the bad option."""
    args.sessions = args.sessions or max(args.concurrency)
    if min(args.concurrency) < 1 or args.sessions < 1:
        raise ValueError("--concurrency and --sessions must be >= 1")
    if max(args.concurrency) > args.sessions:
        raise ValueError(f"--concurrency {max(args.concurrency)} is more than --sessions {args.sessions}: a fixed batch "
                         "of C rows needs C sessions")
    if args.turns < 1 or args.max_new_tokens < 1:
        raise ValueError("--turns and --max-new-tokens must be >= 1")
    if not 0 < args.scale <= 1:
        raise ValueError(f"--scale must be in (0, 1], got {args.scale}")
    if args.batch_buckets and max(args.batch_buckets) < max(args.concurrency):
        raise ValueError(f"--batch-buckets {args.batch_buckets} must reach the largest concurrency "
                         f"{max(args.concurrency)}")
    if args.profile is None:
        args.profile = sorted({min(args.concurrency), max(args.concurrency)})
    if set(args.profile) - set(args.concurrency):
        raise ValueError(f"--profile {args.profile}: profile only concurrencies that run ({args.concurrency})")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available on this machine")


def answer_lengths(group, turn: int, cap: int) -> list[int]:
    return [min(session.turns[turn].output_len, cap) for session in group]


def schedule(sessions, concurrency: int, turns: int, cap: int, max_length: int | None) -> list[int]:
    """The cache length each turn of the first `concurrency` sessions needs (longest prompt + max_new), for
    the turns they run in lockstep and that fit `max_length`."""
    group = sessions[:concurrency]
    lengths, needed = [len(s.first) for s in group], []
    for turn in range(min(turns, *(len(s.turns) for s in group))):
        if turn:
            lengths = [n + answer + len(s.turns[turn].new_tokens)
                       for n, answer, s in zip(lengths, answer_lengths(group, turn - 1, cap), group)]
        need = max(lengths) + max(answer_lengths(group, turn, cap))
        if max_length and need > max_length:
            break
        needed.append(need)
    if not needed:
        raise ValueError(f"concurrency {concurrency}: the first turn needs a cache of {need} tokens, more than "
                         f"--max-length {max_length}; lower --scale or raise --max-length")
    return needed


class StepClock(LogitsProcessor):
    """Stamps each generated step when its logits are ready (generate() calls processors once per step)."""

    def __init__(self, device: torch.device, on_step=None):
        self.device, self.on_step, self.times = device, on_step, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.times.append(time.perf_counter())
        if self.on_step:
            self.on_step()
        return scores


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def serve_batch(model, group, turns: int, cap: int, day_zero: bool, on_step=None) -> tuple[list[dict], float]:
    """Run `group` (the sessions of one fixed batch) for `turns` turns; returns the per-request records and
    the generate() calls' total wall time."""
    prompts, records, wall = [list(s.first) for s in group], [], 0.0
    for turn in range(turns):
        if turn:
            prompts = [p + s.turns[turn].new_tokens for p, s in zip(prompts, group)]
        wanted = answer_lengths(group, turn, cap)
        ids, mask = left_pad(prompts, model.device)
        extra = {CACHE_KWARG: model.new_cache(len(group), ids.shape[1] + max(wanted), **BF16_RECORDS)} \
            if day_zero else {}
        clock = StepClock(model.device, on_step)
        sync(model.device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(wanted), do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]), **extra)
        sync(model.device)
        wall += time.perf_counter() - start
        answers = out[:, ids.shape[1]:].tolist()
        if len(clock.times) != max(wanted) or len(answers[0]) != max(wanted):
            raise RuntimeError(f"generate() stopped after {len(answers[0])} of {max(wanted)} tokens (an end-of-"
                               "sequence id?); the benchmark needs every planned token")
        for session, prompt, n, answer in zip(group, prompts, wanted, answers):
            tpot = (clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 else None
            records.append({"session": session.index, "turn": turn, "prompt_tokens": len(prompt), "new_tokens": n,
                            "batch_new_tokens": max(wanted), "ttft_s": clock.times[0] - start, "tpot_s": tpot,
                            "tokens_s_per_user": 1 / tpot if tpot else None})
        prompts = [p + a[:n] for p, a, n in zip(prompts, answers, wanted)]
    return records, wall


def summarize(records: list[dict], wall: float, turns: int) -> dict:
    generated = sum(r["new_tokens"] for r in records)

    def stat(key):
        return percentiles([r[key] for r in records if r[key] is not None])
    return {"turns": turns, "requests": len(records), "generated_tokens": generated, "wall_s": wall,
            "tokens_s_per_gpu": generated / wall, "prompt_tokens": stat("prompt_tokens"), "ttft_s": stat("ttft_s"),
            "tpot_s": stat("tpot_s"), "tokens_s_per_user": stat("tokens_s_per_user"), "records": records}


def run_config(model, name: str, entry: dict, sessions, system: list[int], args, max_length: int, bar, saved):
    """Serve every concurrency with configuration `name`, filling its entry of the results. system: the
    shared system prefix; saved(): called after each point (partial results survive a timeout)."""
    day_zero, start, text = name == "day-zero", time.perf_counter(), model.model.text_config
    if day_zero:
        if getattr(model, "compiled_runner", None) is not None:
            raise RuntimeError("day-zero must run before the model is compiled")
        text.swa_bounded_replay, model.prefix_cache = False, None
        for layer in model.model.layers:
            layer.ffn.grouped = False  # the reference MoE loop
        context = reference_kernels(model.device.type)
    else:
        from torch._dynamo.utils import counters

        bar.set_description("optimized: compiling")
        options = {"prefill_buckets": tuple(args.prefill_buckets)} if args.prefill_buckets else {}
        options["dynamic_shapes"] = args.dynamic_shapes
        compile_model(model, max_batch=max(args.concurrency), max_length=max_length, backend=args.backend,
                      batch_buckets=tuple(args.batch_buckets or args.concurrency), swa_bounded_replay=True, **options)
        budget = int(args.prefix_cache_gb * 2 ** 30)
        model.enable_prefix_cache(budget)  # before warm_up: prefills with a prefix cache carry replay_from
        model.compiled_runner.warm_up()
        graphs_before = counters["stats"]["unique_graphs"]
        context = nullcontext()
    with context:
        if day_zero:  # untimed, as the optimized warm-up is: CUDA context, library handles, first allocations
            ids = torch.tensor([system], device=model.device)
            model.generate(ids, max_new_tokens=2, pad_token_id=0,
                           **{CACHE_KWARG: model.new_cache(1, ids.shape[1] + 2, **BF16_RECORDS)})
        entry["setup_s"] = time.perf_counter() - start  # optimized: compile and warm-up
        for concurrency in args.concurrency:
            bar.set_description(f"{name} C={concurrency}")
            point = {}
            try:
                if not day_zero:  # a fresh store holding the shared system prefix (see the module docstring)
                    store = model.enable_prefix_cache(budget)
                    model.generate(torch.tensor([system], device=model.device), max_new_tokens=1, pad_token_id=0)
                turns = len(schedule(sessions, concurrency, args.turns, args.max_new_tokens, max_length))
                records, wall = serve_batch(model, sessions[:concurrency], turns, args.max_new_tokens, day_zero,
                                            lambda: bar.update(1))
                point.update(summarize(records, wall, turns))
                if not day_zero:
                    point["prefix_cache"] = vars(store.stats).copy()
                    point["graphs_compiled_while_timed"] = counters["stats"]["unique_graphs"] - graphs_before
                if concurrency in args.profile and name in args.profile_configs:
                    point["profile"] = profile_summary(
                        lambda: serve_batch(model, sessions[:concurrency], 1, args.max_new_tokens, day_zero), top=10)
            except Exception as error:  # noqa: BLE001 - one failing point (e.g. day-zero out of memory) is reported
                point["error"] = f"{type(error).__name__}: {error}"[:500]
                print(f"{name} C={concurrency} failed: {point['error']}")
                if model.device.type == "cuda":
                    torch.cuda.empty_cache()
            entry["concurrency"][str(concurrency)] = point
            saved()


RUN_KEYS = ("command", "date", "commit", "device", "torch")
SAME_KEYS = ("preset", "device", "max_length", "workload")  # what makes two runs' points comparable


def resume(result: dict, path: str, configs: list[str]) -> None:
    """Take the configurations of the run in `path` that are not in `configs` into `result`, after checking
    that it ran the same workload on the same kind of device (ValueError naming what differs)."""
    earlier = json.loads(Path(path).read_text())
    differs = [key for key in SAME_KEYS if earlier.get(key) != json.loads(json.dumps(result[key]))]
    differs += [f"--{key.replace('_', '-')}" for key in ("turns", "max_new_tokens")
                if earlier["options"].get(key) != result["options"][key]]
    if differs:
        raise ValueError(f"--resume {path}: that run differs from this one in {', '.join(differs)}")
    kept = {name: entry for name, entry in earlier["configs"].items() if name not in configs}
    for entry in kept.values():
        entry.setdefault("run", {key: earlier.get(key) for key in RUN_KEYS})
    result["configs"].update(kept)


def curve(entry: dict) -> list[tuple[int, float, float]]:
    """(concurrency, p50 tokens/s per user, tokens/s per GPU) of the points that ran, by concurrency."""
    points = [(int(c), p["tokens_s_per_user"]["p50"], p["tokens_s_per_gpu"]) for c, p in entry["concurrency"].items()
              if "error" not in p and p["tokens_s_per_user"]["p50"] is not None]
    return sorted(points)


def throughput_at(points: list[tuple[int, float, float]], speed: float) -> tuple[float | None, bool]:
    """The highest tokens/s per GPU of a curve (points joined by straight lines, in concurrency order) where
    users get at least `speed` tokens/s, and whether it is the last point (a lower bound); (None, False) if
    no point is that fast."""
    best, at_end = None, False
    for i, (_, user, gpu) in enumerate(points):
        if user >= speed and (best is None or gpu > best):
            best, at_end = gpu, i == len(points) - 1
    for (_, u0, g0), (_, u1, g1) in zip(points, points[1:]):
        if min(u0, u1) < speed < max(u0, u1):
            gpu = g0 + (g1 - g0) * (speed - u0) / (u1 - u0)
            if best is None or gpu > best:
                best, at_end = gpu, False
    return best, at_end


def headline(configs: dict) -> dict | None:
    if not all(name in configs for name in CONFIGS):
        return None
    base, fast = configs["day-zero"], configs["optimized"]
    common = [c for c in base["concurrency"] if "error" not in base["concurrency"][c]
              and "error" not in fast["concurrency"].get(c, {"error": 1})]
    result = {"lowest_concurrency": None}
    if common:
        low = min(common, key=int)
        result["lowest_concurrency"] = int(low)
        for key in ("ttft_s", "tpot_s"):
            b, f = base["concurrency"][low][key]["p50"], fast["concurrency"][low][key]["p50"]
            result[f"{key[:-2]}_speedup_p50"] = b / f if b and f else None
    day_zero_speeds = sorted(user for _, user, _ in curve(base))
    if not day_zero_speeds:
        return result
    speed = day_zero_speeds[(len(day_zero_speeds) - 1) // 2]  # a measured point's speed (lower median)
    result["tokens_s_per_user_constraint"] = speed
    result["constraint_rule"] = "median of day-zero's p50 tokens/s per user over its concurrencies"
    for name, entry in configs.items():
        result[f"{name}_tokens_s_per_gpu_at_constraint"], result[f"{name}_is_lower_bound"] = \
            throughput_at(curve(entry), speed)
    b, f = result["day-zero_tokens_s_per_gpu_at_constraint"], result["optimized_tokens_s_per_gpu_at_constraint"]
    result["throughput_ratio_at_constraint"] = f / b if b and f else None
    return result


def _table(result: dict) -> None:
    rows = [{"config": name, "C": int(c), **{k: v for k, v in p.items() if not isinstance(v, (dict, list))},
             **{f"{k}_{q}": p[k][q] for k in ("ttft_s", "tpot_s", "tokens_s_per_user") if k in p for q in ("p50", "p90")},
             "hits": p.get("prefix_cache", {}).get("hit_tokens")}
            for name, entry in result["configs"].items() for c, p in entry["concurrency"].items()]
    print_table(rows, [("config", "config", ""), ("C", "C", "d"), ("turns", "turns", "d"), ("requests", "requests", "d"),
                       ("TTFT p50 ms", "ttft_s_p50", ".1f", 1e3), ("TTFT p90 ms", "ttft_s_p90", ".1f", 1e3),
                       ("TPOT p50 ms", "tpot_s_p50", ".2f", 1e3), ("TPOT p90 ms", "tpot_s_p90", ".2f", 1e3),
                       ("tok/s/user p50", "tokens_s_per_user_p50", ".1f"), ("tok/s/GPU", "tokens_s_per_gpu", ".1f"),
                       ("prefix hit tokens", "hits", "d"), ("error", "error", "")])


def _print_headline(h: dict | None) -> None:
    def x(value):
        return "-" if value is None else f"{value:.2f}x"
    if not h:
        print("headline: needs both configurations")
        return
    if h.get("lowest_concurrency") is not None:
        print(f"headline, latency at concurrency {h['lowest_concurrency']} (day-zero / optimized, p50): "
              f"TTFT {x(h['ttft_speedup_p50'])}, TPOT {x(h['tpot_speedup_p50'])} faster")
    if "tokens_s_per_user_constraint" in h:
        print(f"headline, throughput at {h['tokens_s_per_user_constraint']:.2f} tokens/s per user "
              f"({h['constraint_rule']}): optimized / day-zero = {x(h['throughput_ratio_at_constraint'])}"
              f"{ratio_bound(h)}")


def ratio_bound(h: dict) -> str:
    """What the throughput ratio is when a curve's last point still meets the speed (its value a lower bound)."""
    base, fast = h.get("day-zero_is_lower_bound"), h.get("optimized_is_lower_bound")
    if base and fast:
        return " (both curves' last points still meet it: the ratio at their highest concurrency, not a bound)"
    if fast:
        return " (at least: the optimized curve's last point still meets it)"
    if base:
        return " (at most: the day-zero curve's last point still meets it)"
    return ""


def _print_profiles(result: dict) -> None:
    for name, entry in result["configs"].items():
        for c, point in entry["concurrency"].items():
            if "profile" in point:
                prof = point["profile"]
                top = ", ".join(f"{t['name'][:40]} {t['total_us'] / 1e3:.1f} ms" for t in prof.get("top", [])[:3])
                print(f"where the time goes, {name} C={c} (one turn, {prof['device']}): {prof['kernels']} kernels, "
                      f"{prof['device_us'] / 1e3:.1f} ms; top: {top}")


def run(args) -> dict:
    """The whole benchmark; returns the results (also written under args.out with the plot)."""
    check_arguments(args)
    device = torch.device(args.device)
    model = preset_model(args.preset, device, args.seed)
    workload = WorkloadConfig(sessions=args.sessions, scale=args.scale, seed=args.seed,
                              vocab_size=model.model.text_config.vocab_size)
    sessions = make_workload(workload)
    system = sessions[0].first[:workload.system_tokens]
    needs = {c: schedule(sessions, c, args.turns, args.max_new_tokens, args.max_length) for c in args.concurrency}
    max_length = args.max_length or max(max(n) for n in needs.values())
    steps = sum(max(answer_lengths(sessions[:c], t, args.max_new_tokens)) for c, n in needs.items()
                for t in range(len(n)))
    result = {**run_metadata(), "preset": args.preset, "batching": BATCHING, "gpus": 1, "max_length": max_length,
              "options": {k: v for k, v in vars(args).items() if not callable(v)},
              "workload": workload_stats(workload, sessions), "configs": {}}
    name, path = f"serve-{args.preset}", None
    if args.resume:
        resume(result, args.resume, args.configs)

    def saved():
        nonlocal path
        result["headline"] = headline(result["configs"])
        path = save_results(result, name, args.out)

    print(f"{args.preset} on {result['device']}: {BATCHING}")
    with tqdm(total=steps * len(args.configs), unit="step") as bar:
        for config in args.configs:
            entry = result["configs"][config] = {"run": {key: result[key] for key in RUN_KEYS}, "concurrency": {}}
            run_config(model, config, entry, sessions, system, args, max_length, bar, saved)
    try:
        from .serve_plot import plot
        plot(result, path.with_suffix(".png"))
    except ImportError:
        print(f"matplotlib is not installed here: make the plot later with `dsflash bench plot {path}`")
    print()
    _print_profiles(result)
    _print_headline(result["headline"])
    _table(result)
    return result
