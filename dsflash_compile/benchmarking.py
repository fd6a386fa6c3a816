"""Timing helpers shared by the benchmark scripts (one GPU; see shared/spec/BENCHMARKS.md's method)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from pathlib import Path

import torch


def assignment(text: str) -> tuple[str, bool | int]:
    """A command line's NAME=VALUE (an argparse type) with VALUE true, false or an integer."""
    name, sep, value = text.partition("=")
    if sep and value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    if sep and value.removeprefix("-").isdigit():
        return name, int(value)
    raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE with VALUE true, false or an integer")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (host clocks then time real work on CUDA; a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentiles(values: list[float]) -> dict:
    """p50 (median), p90 (nearest rank) and mean; None for each when there are no values."""
    if not values:
        return {"p50": None, "p90": None, "mean": None}
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "mean": statistics.fmean(ordered)}


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device copy (median of 20 after 2 warm-ups)."""
    x = torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(22):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() * 2 / statistics.median(times[2:])


def time_graph(fn, calls: int = 10, replays: int = 20) -> float:
    """Median seconds per call of `fn` captured `calls` times in one CUDA graph (launches excluded)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times[2:])


def time_eager(fn, iters: int = 10) -> float:
    """Mean seconds per call of `fn` over `iters` calls issued without waiting for each (launch overheads included:
    the day-zero path; for a CUDA-graph step, the GPU's own time when the host runs ahead)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def timed(row: dict, key: str, measure) -> None:
    """row[key] = measure(), or the error as text: one failing point does not stop the run."""
    try:
        row[key] = measure()
    except Exception as error:  # noqa: BLE001 - reported in the results, the run goes on
        row[key] = None
        row[key + "_error"] = f"{type(error).__name__}: {error}"[:500]
        print(key, "failed:", row[key + "_error"])


def fused_speedups(row: dict) -> None:
    """Add fused_vs_eager / fused_vs_compiled to a row timed as eager_graph_s, compiled_graph_s, fused_graph_s."""
    if row.get("fused_graph_s"):
        row["fused_vs_eager"] = (row.get("eager_graph_s") or float("nan")) / row["fused_graph_s"]
        row["fused_vs_compiled"] = (row.get("compiled_graph_s") or float("nan")) / row["fused_graph_s"]


def sweep_variant(row: dict, call, agrees, calls: int = 10, replays: int = 20) -> dict:
    """One launch variant of a sweep (scripts/sweep_*.py): its output checked first (`agrees(call())`),
    then its CUDA-graph time; both go into `row` ('agrees', 's'), which is printed and returned."""
    row.update(agrees=bool(agrees(call())), s=time_graph(call, calls=calls, replays=replays))
    print(row, flush=True)
    return row


def fastest(rows) -> list[dict]:
    """A sweep's rows (sweep_variant's) that agreed with the reference and were timed, fastest first."""
    return sorted((r for r in rows if r.get("agrees") and "s" in r), key=lambda r: r["s"])


# NCCL's kernels on the GPU; on the CPU the collectives' operators (_c10d_functional::*, c10d::*, gloo:*), whose
# self time is mostly the wait for the other ranks
COLLECTIVE_NAMES = ("nccl", "c10d", "gloo")


def profile_summary(step, trace_path: str | None = None, top: int = 0) -> dict:
    """Run `step` once under torch.profiler: the kernels it launched on the GPU (on a machine without one,
    its CPU operators) with their total time, the part of it in collectives (comm_us), the step's wall time
    (far above the kernel time: launch- or host-bound), and the `top` names by time; optionally a Chrome
    trace. On a GPU without a trace it records the kernels only (the CPU operators of an eager 40-layer step,
    ~10^5, take seconds to list; a trace keeps them: trace_summary counts the launches)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    cpu = not cuda or trace_path is not None
    activities = ([ProfilerActivity.CPU] if cpu else []) + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if cuda:
        events = [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        events = [(e.name, e.self_cpu_time_total) for e in prof.events()]
    result = {"device": "cuda" if cuda else "cpu", "kernels": len(events), "device_us": sum(t for _, t in events),
              "comm_us": sum(t for name, t in events if any(word in name.lower() for word in COLLECTIVE_NAMES)),
              "wall_us": wall * 1e6}
    if top:
        by_name: dict[str, list] = {}
        for name, t in events:
            by_name.setdefault(name, []).append(t)
        ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        result["top"] = [{"name": n[:120], "calls": len(t), "total_us": round(sum(t), 1)} for n, t in ranked]
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return result


def weight_family(name: str, shared_in_moe: bool = False) -> str:
    """The kernel family (scripts/trace_summary.py's names) that reads checkpoint tensor `name` at decode.
    shared_in_moe: the shared expert runs in the routed experts' kernels (compile() stacks a bf16 MoE's:
    CompileOptions.moe_shared_stacked), else in the dense projections'."""
    if ".ffn.experts." in name or (shared_in_moe and ".ffn.shared_experts." in name):
        return "moe"
    if ".ffn.gate." in name:
        return "router"
    if ".hc_" in name:
        return "mhc"
    if name.endswith(("norm.weight", ".bias", ".bias_vl", "attn_sink")):
        return "elementwise"
    return "gemm"  # the dense projections (shared experts, head, compressor, indexer, Engram included)


def decode_traffic(model, batch: int, context: int, shared_in_moe: bool = False) -> dict:
    """Bytes that must move in one decode step of `batch` rows at `context` tokens, by kernel family, and the
    step's FLOPs. Weights once, as held (bf16, or FP8/MXFP4 bytes + scales with native weights): everything
    but the embedding and Engram tables (one row each per token) and the routed experts no token picked.
    Caches once: each layer's window + top-k compressed rows (attention) and the index keys its indexer
    scores (indexer). shared_in_moe: as weight_family's. The model may live on the meta device."""
    from .custom_ops import records

    text = model.model.text_config
    experts_used = min(text.n_routed_experts, batch * text.num_experts_per_tok)
    families = dict.fromkeys(("moe", "gemm", "mhc", "router", "elementwise", "attention", "indexer"), 0)
    flops = 0
    for name, t in model.state_dict().items():  # checkpoint tensors: stacked experts are not counted twice
        size = t.numel() * t.element_size()
        if ".embed." in name or name.startswith("model.embed"):
            continue
        # weights multiply one value per element (two for packed E2M1 bytes); scales multiply nothing
        values = 0 if name.endswith(".scale") else t.numel() * (2 if t.dtype == torch.int8 else 1)
        if ".ffn.experts." in name:
            size *= experts_used / text.n_routed_experts
            flops += 2 * batch * text.num_experts_per_tok / text.n_routed_experts * values
        else:
            flops += 2 * batch * values
        families[weight_family(name, shared_in_moe)] += size
    rec = {"window": records.record_bytes("fp8", text.head_dim),
           "compressed": records.record_bytes("nvfp4", text.head_dim),
           "index": records.record_bytes("mxfp4", text.index_head_dim)}
    for role in text.layer_roles:
        keys = text.sliding_window
        families["attention"] += batch * text.sliding_window * rec["window"]
        if role.ratio:
            rows = context // role.ratio
            picked = min(text.index_topk, rows)
            keys += picked
            families["attention"] += batch * picked * rec["compressed"]
            if role.is_index_source:
                scored = min(rows, text.candidate_topk_blocks * text.candidate_block_size) if role.uses_candidates \
                    else rows
                families["indexer"] += batch * scored * rec["index"]
                flops += batch * 2 * text.index_n_heads * text.index_head_dim * scored
        flops += batch * 4 * text.num_attention_heads * text.head_dim * keys
    return {"bytes": families, "flops": flops}


def print_table(rows: list[dict], columns: list[tuple]) -> None:
    """The rows as a right-aligned text table. columns: (header, key, format spec) or (header, key, format
    spec, scale); a missing, None or NaN value prints as '-'."""
    def cell(row, key, spec, scale=1):
        value = row.get(key)
        if value is None or value != value:
            return "-"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return format(str(value), spec)
        return format(value * scale, spec)
    cells = [[cell(row, *column[1:]) for column in columns] for row in rows]
    widths = [max([len(column[0])] + [len(line[i]) for line in cells]) for i, column in enumerate(columns)]
    for line in [[column[0] for column in columns], *cells]:
        print(" ".join(text.rjust(width) for text, width in zip(line, widths)))


def run_metadata() -> dict:
    import triton

    # DSFLASH_COMMIT names the code when the checkout's git metadata is not its own (the GPU machine gets a
    # copy of the working tree whose .git can be older than the files); uncommitted changes are flagged.
    commit = os.environ.get("DSFLASH_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                 text=True).stdout.strip()
    if commit and "DSFLASH_COMMIT" not in os.environ and subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip():
        commit += " + uncommitted changes"
    return {"command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (" + platform.machine() + ")",
            "torch": torch.__version__, "triton": triton.__version__,
            "host": platform.node(), "commit": commit or "unknown (no git checkout here)"}


def save_results(result: dict, name: str, out_dir: str) -> Path:
    """Write `result` as <out_dir>/<name>-<date>.json and return the path."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", path)
    return path
