"""Decode step time and prefill throughput of each parallel mode (parallel.py) against one GPU, with the share
of the time spent in collectives (issue 10), one process per GPU:

    torchrun --nproc-per-node 2 scripts/bench_parallel.py --preset flash-40l-e8 --batch 1 8 64 --prefill 4096 \\
        --out benchmarks/results [--modes 1gpu tp ep tp+ep dp+ep] [--compile]
    torchrun --nproc-per-node 2 scripts/bench_parallel.py --preset tiny --batch 1 2 --prefill 16 --context 32
        (on a machine without GPUs: gloo on the CPU, what tests/test_bench_parallel.py runs)

Mode "1gpu" is the baseline: the unsharded model on rank 0 alone while the other ranks wait, so it runs in the
same run, on the same seeded weights, GPU and software as the sharded modes (the ratios are side by side, as
BENCHMARKS.md asks); with --nproc-per-node 1 only it runs. Every rank builds the same seeded preset and shards
it (a mode's ranks run the same inputs; under DP attention each rank its own requests of the same [B, S], so a
step serves world x B requests). The routed experts run grouped (stacked, no host syncs: the path compile uses).

Per mode: prefill of one --prefill-token prompt per rank, and decode steps at each --batch with --context
cached rows per request (random records, see compile_and_profile.fill_cache). Each timed call starts on all
ranks together (synchronize + barrier) and is timed on the host to its synchronize; a row's time is the
slowest rank's median over --repeats prefills / --steps decode steps, after one untimed call (which compiles
and captures with --compile: first_call_s). Then one prefill / --profile-steps decode steps under
torch.profiler per rank give comm_share: GPU time in NCCL kernels over all kernel time (NCCL kernels also count
the wait for the other rank); on the CPU the collectives' operators' self time over all operators'.
--compile: dsflash_compile.compile per mode (decode as one CUDA graph per batch); a mode that fails is
reported under its "error" and the run goes on. Rank 0 writes parallel-<preset>[-compiled]-<date>.json after
every row (a run cut short keeps what it measured) and every mode.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import dsflash_compile
from compile_and_profile import fill_cache
from dsflash_compile.benchmarking import print_table, profile_summary, run_metadata, save_results, sync
from dsflash_compile.parallel import LAYOUT_NAMES, init_distributed, layout, layout_fits, parallelize
from dsflash_compile.presets import preset_model


def time_calls(call, repeats: int, device: torch.device, barrier, before=lambda: None) -> tuple[float, float]:
    """(seconds of the first call, median seconds of the next `repeats`); `before` runs untimed before each."""
    times = []
    for _ in range(repeats + 1):
        before()
        sync(device)
        barrier()
        start = time.perf_counter()
        call()
        sync(device)
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def measure(call, repeats: int, profiled: int, device, barrier, before=lambda: None) -> dict:
    """This rank's timing of `call` and its collectives' share of `profiled` calls (see the module doc)."""
    first, median = time_calls(call, repeats, device, barrier, before)
    before()
    sync(device)
    barrier()
    profile = profile_summary(lambda: [call() for _ in range(profiled)])
    share = profile["comm_us"] / profile["device_us"] if profile["device_us"] else None  # None: nothing recorded
    return {"first_call_s": first, "s": median, "comm_share": share, "profile_us": profile["device_us"]}


@torch.no_grad()
def run_mode(model, mode: str, args, device: torch.device, barrier, gather, keep) -> None:
    """The mode's rows (the same on every rank), each handed to `keep` as soon as it is measured (a run cut
    short keeps them): prefill, then decode at each batch."""
    dp, rank = mode == "dp+ep", dist.get_rank()
    requests = dist.get_world_size() if dp else 1  # requests per row of a call, over all ranks
    gen = torch.Generator().manual_seed(1 + (rank if dp else 0))  # DP: each rank its own requests
    fill_gen = torch.Generator(device=device).manual_seed(0)
    vocab = model.model.text_config.vocab_size
    max_length = max(args.prefill + 1, args.context + args.steps + args.profile_steps + 1)
    if args.compile:
        dsflash_compile.compile(model, max_batch=max(args.batch), max_length=max_length, backend=args.backend,
                                batch_buckets=tuple(sorted({1, *args.batch})), prefill_buckets=(args.prefill,))
        # (bucket 1 for the one-prompt prefill: another bucket would pad it with inert rows)
    else:
        for block in model.model.layers:
            if not block.ffn.grouped:
                block.ffn.stack_experts()
    cache = model.empty_cache(max(args.batch), max_length)

    def row(phase: str, batch: int, tokens: int, local: dict) -> dict:
        ranks = gather(local)
        seconds = max(r["s"] for r in ranks)
        out = {"mode": mode, "phase": phase, "batch": batch, "tokens": tokens * requests, "s": seconds,
               "tokens_per_s": tokens * requests / seconds, "first_call_s": ranks[0]["first_call_s"]}
        for key in ("s", "comm_share", "profile_us"):
            out[key + "_per_rank"] = [r[key] for r in ranks]
        if rank == 0:
            print(mode, phase, batch, {k: v for k, v in out.items() if k not in ("mode", "phase", "batch")}, flush=True)
        return out

    prompt = torch.randint(3, vocab, (1, args.prefill), generator=gen).to(device)
    keep(row("prefill", 1, args.prefill, measure(lambda: model(prompt, cache=cache, logits_to_keep=1),
                                                  args.repeats, 1, device, barrier, cache.reset)))
    for batch in args.batch:
        ids = torch.randint(3, vocab, (batch, 1), generator=gen).to(device)
        mask = torch.ones_like(ids)
        cache.reset()
        fill_cache(cache, batch, args.context, fill_gen)
        local = measure(lambda: model(ids, mask, cache=cache, logits_to_keep=1), args.steps, args.profile_steps,
                        device, barrier)
        keep(row("decode", batch, batch, local))


def add_ratios(rows: list[dict], baseline: list[dict]) -> None:
    """speedup (1 GPU's seconds per call / the mode's) and tokens_per_s_vs_1gpu, at the same per-rank batch;
    the 1gpu rows of `rows`, else of `baseline` (an earlier run's)."""
    base = {(r["phase"], r["batch"]): r for r in baseline + rows if r["mode"] == "1gpu"}
    for r in rows:
        one = base.get((r["phase"], r["batch"]))
        if one and r["mode"] != "1gpu":
            r["speedup"] = one["s"] / r["s"]
            r["tokens_per_s_vs_1gpu"] = r["tokens_per_s"] / one["tokens_per_s"]


def all_gathered(value, world: int, group) -> list:
    out = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


NOTES = {"batch": "requests per rank (dp+ep: each rank its own; 'tokens' counts every rank's)",
         "s": "median seconds per call of the slowest rank (s_per_rank: each rank's)",
         "speedup": "1gpu s / s at the same per-rank batch (dp+ep serves world x the requests in its s)",
         "tokens_per_s_vs_1gpu": "tokens_per_s / 1gpu tokens_per_s at the same per-rank batch",
         "comm_share_per_rank": "GPU: NCCL kernel time / all kernel time of the profiled calls (includes waiting "
                                "for the other rank); CPU: collective operators' self time / all operators'"}

COLUMNS = [("mode", "mode", ""), ("phase", "phase", ""), ("batch", "batch", "d"), ("ms", "s", ".2f", 1e3),
           ("tokens/s", "tokens_per_s", ".0f"), ("speedup", "speedup", ".2f"),
           ("tok/s vs 1 GPU", "tokens_per_s_vs_1gpu", ".2f"), ("comm % rank 0", "comm_share_rank0", ".1f", 100)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="flash-40l-e8")
    parser.add_argument("--modes", nargs="+", default=list(LAYOUT_NAMES), choices=LAYOUT_NAMES)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="decode requests per rank")
    parser.add_argument("--prefill", type=int, default=4096, help="prompt tokens per rank")
    parser.add_argument("--context", type=int, default=4096, help="cached tokens per request while decoding")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills")
    parser.add_argument("--profile-steps", type=int, default=2, help="profiled decode steps per batch")
    parser.add_argument("--weights", choices=["native", "bf16"], default="bf16",
                        help="FP8/MXFP4 projections kept as stored (native) or dequantized to bf16")
    parser.add_argument("--compile", action="store_true", help="dsflash_compile.compile each mode's model")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend with --compile")
    parser.add_argument("--baseline", help="an earlier run's JSON whose 1gpu rows the ratios use (when this run "
                        "has none: --compile runs one mode per command)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    baseline = json.loads(Path(args.baseline).read_text())["rows"] if args.baseline else []

    # the collectives' group, and a gloo one for the host-side barriers: its long timeout lets the other ranks
    # wait while rank 0 alone measures (and compiles) the 1-GPU baseline
    group = init_distributed()
    host = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    name = f"parallel-{args.preset}" + ("-compiled" if args.compile else "")
    result = {**run_metadata(), "preset": args.preset, "weights": args.weights, "world": world,
              "compile": args.compile, "backend": args.backend if args.compile else None, "prefill": args.prefill,
              "context": args.context, "steps": args.steps, "repeats": args.repeats, "baseline": args.baseline,
              "notes": NOTES, "modes": {}, "rows": []}
    result["command"] = (f"torchrun --nproc-per-node {world} scripts/bench_parallel.py "
                         + " ".join(sys.argv[1:] if argv is None else argv))

    def keep(row: dict) -> None:
        result["rows"].append(row)
        if rank == 0:
            add_ratios(result["rows"], baseline)
            save_results(result, name, args.out)

    for mode in args.modes:
        solo = mode == "1gpu"
        info = result["modes"].setdefault(mode, {})
        if not solo and not layout_fits(mode, world):
            info["skipped"] = "needs 2 ranks"
            continue
        if solo and rank != 0:
            dist.barrier(group=host)  # wait while rank 0 measures alone
            continue
        counters.clear()
        try:
            model = preset_model(args.preset, device, weights=args.weights)
            if not solo:
                config = layout(mode, world)
                info["config"] = vars(config)
                parallelize(model, config, group)
            barrier = (lambda: None) if solo else (lambda: dist.barrier(group=host))
            gather = (lambda x: [x]) if solo else (lambda x: all_gathered(x, world, host))
            run_mode(model, mode, args, device, barrier, gather, keep)
        except Exception as error:  # noqa: BLE001 - reported in the results (e.g. a compile failure), the run goes on
            info["error"] = f"{type(error).__name__}: {error}"[:2000]
            print(mode, "failed:", info["error"], flush=True)
        if args.compile:
            info["graph_breaks"] = sum(counters["graph_break"].values())
            info["unique_graphs"] = counters["stats"]["unique_graphs"]
            torch._dynamo.reset()
        model = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if solo:
            dist.barrier(group=host)
        if rank == 0:
            save_results(result, name, args.out)  # the mode's info (graph breaks, errors)

    if rank == 0:
        save_results(result, name, args.out)
        print_table([dict(r, comm_share_rank0=r["comm_share_per_rank"][0]) for r in result["rows"]], COLUMNS)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
