"""Where the compiled decode step's host time goes: the step as the benchmark times it (the GPU idle at its start)
against the same step queued behind a GPU sleep (every launch done before the GPU reaches it), and the host time
of its parts (the runner's work before the first graph piece's launch, each piece's launch) in both cases.

    python scripts/probe_decode_launch.py --preset flash-40l-e8 --batch 1 --out benchmarks/results

The difference between the two step times is what the host's launches cost the GPU. --upload also times the
pieces after cuGraphUpload of each (the driver's upload of a graph's launch resources ahead of its launch).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

import dsflash_compile
from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.benchmarking import run_metadata, save_results
from dsflash_compile.piecewise_graph import PiecewiseGraph

from compile_and_profile import decode_step, fill_cache, step_time

SLEEP_CYCLES = 4_000_000  # ~2 ms at the H200's clocks: far longer than the step's host work


def timed_step(step, queued: bool, clock: "LaunchClock") -> tuple[float, float]:
    """(GPU seconds from the step's first stream op to its last, host seconds of the call); queued: behind a
    GPU sleep, so the GPU never waits for the host. Tells the clock when the call started."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued:
        torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    host = clock.call_start = time.perf_counter()
    step()
    host = time.perf_counter() - host
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, host


class LaunchClock:
    """Host time of each piece's replay() and, per call, from the call's start (timed_step) to the first
    replay: the runner's own work before the GPU gets its first piece (patched onto PiecewiseGraph while
    installed)."""

    def __init__(self):
        self.times: list[list[float]] = []
        self.before_first: list[float] = []
        self.call_start = None
        self._replay = PiecewiseGraph.replay

    def __enter__(self):
        clock = self

        def replay(graph):
            clock.before_first.append(time.perf_counter() - clock.call_start)
            times = []
            for piece in graph.graphs:
                t = time.perf_counter()
                piece.replay()
                times.append(time.perf_counter() - t)
            clock.times.append(times)
        PiecewiseGraph.replay = replay
        return self

    def __exit__(self, *exc):
        PiecewiseGraph.replay = self._replay


def upload(runner) -> int:
    """cuGraphUpload of every decode piece on the current stream; how many were uploaded."""
    cuda = ctypes.CDLL("libcuda.so.1")
    stream = torch.cuda.current_stream().cuda_stream
    count = 0
    for graph, *_ in runner.graphs.values():
        for piece in graph.graphs:
            code = cuda.cuGraphUpload(ctypes.c_void_p(piece.raw_cuda_graph_exec()), ctypes.c_void_p(stream))
            if code:
                raise RuntimeError(f"cuGraphUpload failed: CUresult {code}")
            count += 1
    torch.cuda.synchronize()
    return count


def measure(step, steps: int) -> dict:
    row = {}
    for queued in (False, True):
        name = "queued" if queued else "idle"
        with LaunchClock() as clock:
            pairs = [timed_step(step, queued, clock) for _ in range(steps)]
        gpu, host = zip(*pairs)
        pieces = [statistics.median(t[i] for t in clock.times) * 1e6 for i in range(len(clock.times[0]))]
        row[name] = {"gpu_us": statistics.median(gpu) * 1e6, "host_us": statistics.median(host) * 1e6,
                     "before_first_launch_us": statistics.median(clock.before_first) * 1e6,
                     "piece_launch_us": pieces, "gpu_us_all": [g * 1e6 for g in gpu]}
    row["host_cost_us"] = row["idle"]["gpu_us"] - row["queued"]["gpu_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="flash-40l-e8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--upload", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    config = preset_config(args.preset, weights="bf16")
    with torch.device("cuda"):
        model = DeepseekV41ForCausalLM(config).eval()
    torch.set_grad_enabled(False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, config.text_config.vocab_size, (args.batch, 1), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    max_length = args.context + 4 * args.steps * 8 + 64
    dsflash_compile.compile(model, max_batch=args.batch, max_length=max_length, batch_buckets=(args.batch,))
    runner = model.compiled_runner
    fill_cache(runner.cache, args.batch, args.context, torch.Generator(device="cuda").manual_seed(args.batch))
    step = decode_step(runner, ids, mask, args.context)
    for _ in range(3):
        step()
    torch.cuda.synchronize()

    result = {**run_metadata(), "preset": args.preset, "batch": args.batch, "context": args.context,
              "pieces": len(runner.graphs[args.batch][0].graphs)}
    result["step_time_us"] = step_time(step, args.steps) * 1e6
    result["plain"] = measure(step, args.steps)
    if args.upload:
        result["uploaded_pieces"] = upload(runner)
        result["after_upload"] = measure(step, args.steps)
    result["step_time_us_again"] = step_time(step, args.steps) * 1e6
    path = save_results(result, f"decode-launch-{args.preset}-b{args.batch}", args.out)
    print(f"step {result['step_time_us']:.1f} / {result['step_time_us_again']:.1f} us  -> {path}")
    for key in ("plain", "after_upload"):
        if key in result:
            row = result[key]
            print(f"{key}: GPU idle at start {row['idle']['gpu_us']:.1f} us, queued {row['queued']['gpu_us']:.1f} us "
                  f"(host cost {row['host_cost_us']:.1f}); host call {row['idle']['host_us']:.1f} / "
                  f"{row['queued']['host_us']:.1f} us, {row['idle']['before_first_launch_us']:.1f} us of it before the "
                  "first launch")
            for name in ("idle", "queued"):
                print(f"  piece launches ({name}) us: " + " ".join(f"{t:.1f}" for t in row[name]['piece_launch_us']))


if __name__ == "__main__":
    main()
