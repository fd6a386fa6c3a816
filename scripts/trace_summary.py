"""Where a profiled decode step spends its GPU time: kernels grouped by family, against each family's floor.

    python scripts/trace_summary.py benchmarks/results/decode-trace-flash-40l-e8-b1-passes-2026-11-30.json.gz \
        --preset flash-40l-e8 --batch 1 --context 4096 --out summary.json

Reads a Chrome trace (json or json.gz, as torch.profiler writes; compile_and_profile.py's decode-trace-*)
holding one step. Prints per family (moe, gemm, mhc, router, attention, indexer, topk, inductor, aten,
memcpy, ...): device time, launches, time per launch, its share of the step's span (path: each kernel's end
minus the latest end before it, in order of ends; with programmatic dependent launch a kernel starts early and
waits, so its duration includes the kernel before it and durations overlap, while the path adds up to the span)
and with --preset the family's floor (bytes it must read, benchmarking.decode_traffic, over --bandwidth)
against both; then the stream's busy and idle time (idle between
the step's first and last kernel: launch gaps inside a CUDA graph, or host waits when the step is not
one graph), the largest gaps, whether the step was a CUDA-graph replay (cudaGraphLaunch), and the
slowest launch configurations (kernel + grid) of each family, which tell the GEMM shapes apart. --layer lists one
layer's kernels in order (--median: over the layers launching the same ones); --layers every layer's path and what
it launches beyond the common layer (the compressor, indexer and Engram layers' extra kernels); --against another
trace of the step (a variant's): the span, each family's and each layer's path in both and the difference.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
from collections import Counter
from pathlib import Path

# first match wins; names are those of the kernels (Triton: the @triton.jit function's name)
FAMILIES = (
    ("moe", r"GroupProblem|prepare_grouped_gemm_data|_grouped_kernel|_grouped_swiglu_kernel|^_up_kernel|^_down_kernel|"
            r"_expert_order_kernel"),
    ("gemm", r"nvjet|gemv|splitKreduce|cublas|cutlass|xmma|gemm|_fp8_linear_kernel|_bf16_linear_kernel"),
    ("mhc", r"_seam|sinkhorn|_finish_rows_kernel|_mixes_finish_kernel"),
    ("router", r"_router_kernel"),
    ("attention", r"_attention_kernel|_merge_kernel"),
    ("cache_write", r"_record_write"),
    ("indexer", r"_scores_kernel|_candidate_union_kernel|_block_max_kernel"),
    ("topk", r"_histogram_kernel|_compact_kernel|_chunk_select_kernel|_finish_kernel|_row_topk_kernel"),
    ("compressor", r"_compress_token_kernel"),
    ("inductor", r"^triton_"),
    ("aten", r"at::|at_cuda_detail|cub::"),
)
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_GAP_US = 100.0  # a gap this long inside a step is the host (launching, syncing), not a graph's launch latency

# benchmarking.copy_bandwidth() on the H200 (compile-profile-flash-40l-e8-*-2026-11-30.json: 4.167e12)
H200_COPY_BANDWIDTH = 4.17e12


def family(name: str, category: str = "kernel") -> str:
    if category != "kernel":
        return "memcpy"
    return next((fam for fam, pattern in FAMILIES if re.search(pattern, name)), "other")


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def device_events(events: list[dict]) -> list[dict]:
    """The trace's kernels and copies on the GPU, in time order."""
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
                  key=lambda e: e["ts"])


def path_shares(device: list[dict]) -> list[float]:
    """Each event's share of the span (in device's order): its end minus the latest end of the events that end
    before it (0 if none ends later than that), the first one's from the first start. They add up to the span."""
    shares = [0.0] * len(device)
    latest = min((e["ts"] for e in device), default=0.0)
    for i in sorted(range(len(device)), key=lambda i: device[i]["ts"] + device[i]["dur"]):
        end = device[i]["ts"] + device[i]["dur"]
        shares[i], latest = max(0.0, end - latest), max(latest, end)
    return shares


def summarize(events: list[dict], floor_bytes: dict | None = None, bandwidth: float = H200_COPY_BANDWIDTH) -> dict:
    """The step's device work by family and its idle time; floor_bytes: family -> bytes it must move."""
    device = device_events(events)
    families: dict[str, dict] = {}
    configs: dict[tuple, dict] = {}
    for e, share in zip(device, path_shares(device)):
        fam = family(e["name"], e["cat"])
        row = families.setdefault(fam, {"family": fam, "us": 0.0, "path_us": 0.0, "launches": 0})
        row["us"] += e["dur"]
        row["path_us"] += share
        row["launches"] += 1
        key = (fam, e["name"][:90], str(e.get("args", {}).get("grid")))
        config = configs.setdefault(key, {"family": fam, "name": key[1], "grid": key[2], "us": 0.0, "launches": 0})
        config["us"] += e["dur"]
        config["launches"] += 1
    busy = sum(row["us"] for row in families.values())
    for row in families.values():
        row["us_per_launch"] = row["us"] / row["launches"]
        row["share"] = row["us"] / busy
        if floor_bytes and floor_bytes.get(row["family"]):
            row["floor_us"] = floor_bytes[row["family"]] / bandwidth * 1e6
            row["vs_floor"] = row["us"] / row["floor_us"]
            row["path_vs_floor"] = row["path_us"] / row["floor_us"]
    gaps, end = [], None
    for e in device:
        if end is not None and e["ts"] > end:
            gaps.append({"us": e["ts"] - end, "before": e["name"][:90]})
        end = max(end or e["ts"], e["ts"] + e["dur"])
    span = end - device[0]["ts"] if device else 0.0
    idle = sum(g["us"] for g in gaps)
    host_gaps = sum(g["us"] for g in gaps if g["us"] >= HOST_GAP_US)
    runtime = [e["name"] for e in events if e.get("cat") == "cuda_runtime"]
    return {
        "kernels": len(device), "busy_us": busy, "span_us": span, "idle_us": idle, "host_gap_us": host_gaps,
        "launch_gap_us": idle - host_gaps, "graph_launches": runtime.count("cudaGraphLaunch"),
        "kernel_launches": sum(name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
                               for name in runtime),
        "families": sorted(families.values(), key=lambda row: -row["us"]),
        "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[:5],
        "configs": sorted(configs.values(), key=lambda row: -row["us"]),
    }


def all_layer_kernels(events: list[dict], marker: str = "_router_kernel") -> tuple[list[list[dict]], int]:
    """Every layer's device work, each from one launch of `marker` (once per layer: the router) up to the next,
    in order: each kernel's name, grid, duration, share of the span (path_shares) and the idle gap before it;
    and how many launches of `marker` the trace holds. The events are sorted and shared out once."""
    device = device_events(events)
    shares = path_shares(device)
    marks = [i for i, e in enumerate(device) if e["name"] == marker]
    layers = []
    for start, stop in zip(marks, marks[1:]):
        rows, end = [], None
        for e, share in zip(device[start:stop], shares[start:stop]):
            rows.append({"gap_us": 0.0 if end is None else max(0.0, e["ts"] - end), "us": e["dur"],
                         "path_us": share, "grid": str(e.get("args", {}).get("grid")), "name": e["name"][:90]})
            end = e["ts"] + e["dur"]
        layers.append(rows)
    return layers, len(marks)


def layer_kernels(events: list[dict], marker: str = "_router_kernel", index: int = 0) -> list[dict]:
    """all_layer_kernels' layer `index` (where one layer's time goes)."""
    return _layer(*all_layer_kernels(events, marker), marker, index)


def _layer(layers: list[list[dict]], launches: int, marker: str, index: int) -> list[dict]:
    if index >= len(layers):
        raise ValueError(f"trace_summary: {launches} launches of {marker}; layer {index} needs {index + 2}")
    return layers[index]


def layer_medians(events: list[dict], marker: str = "_router_kernel", index: int = 0) -> tuple[list[dict], int]:
    """layer_kernels(index) with each kernel's us, path us and gap the median over every layer that launches the
    same kernels in the same order (one layer's figures move by a few us from layer to layer: PDL waits, the
    memory system), and how many layers that is."""
    layers, launches = all_layer_kernels(events, marker)
    rows = [dict(row) for row in _layer(layers, launches, marker, index)]
    names = [r["name"] for r in rows]
    alike = [other for other in layers if [r["name"] for r in other] == names]
    for position, row in enumerate(rows):
        for key in ("us", "path_us", "gap_us"):
            row[key] = statistics.median(other[position][key] for other in alike)
    return rows, len(alike)


def layer_overview(events: list[dict], marker: str = "_router_kernel", extra: int = 4) -> list[dict]:
    """Every layer's path and kernels against the common layer (the kernel sequence most layers launch): the path
    of the kernels it launches beyond that layer's (by name, counted) and the `extra` largest of them, where the
    compressor, indexer and Engram layers spend their time."""
    layers, _ = all_layer_kernels(events, marker)
    sequences = [tuple(r["name"] for r in rows) for rows in layers]
    common = Counter(max(set(sequences), key=sequences.count)) if layers else Counter()
    overview = []
    for index, rows in enumerate(layers):
        left, beyond = Counter(common), []
        for row in rows:
            if left[row["name"]] > 0:
                left[row["name"]] -= 1
            else:
                beyond.append(row)
        overview.append({"layer": index, "path_us": sum(r["path_us"] for r in rows), "kernels": len(rows),
                         "extra_path_us": sum(r["path_us"] for r in beyond),
                         "extra": [(r["name"], r["path_us"]) for r in sorted(beyond, key=lambda r: -r["path_us"])]
                         [:extra]})
    return overview


def compare_traces(events: list[dict], other: list[dict], marker: str = "_router_kernel") -> dict:
    """Two traces of the same step (two builds: a variant against the defaults): the span, each family's path and
    each layer's path in both, and `other`'s less this one's (where a variant's time went)."""
    mine, theirs = summarize(events), summarize(other)
    paths = [{row["family"]: row["path_us"] for row in s["families"]} for s in (mine, theirs)]
    families = [{"family": fam, "path_us": paths[0].get(fam, 0.0), "other_path_us": paths[1].get(fam, 0.0),
                 "delta_us": paths[1].get(fam, 0.0) - paths[0].get(fam, 0.0)}
                for fam in sorted(set(paths[0]) | set(paths[1]), key=lambda f: -max(paths[0].get(f, 0.0),
                                                                                   paths[1].get(f, 0.0)))]
    layers = [{"layer": a["layer"], "path_us": a["path_us"], "other_path_us": b["path_us"], "kernels": a["kernels"],
               "other_kernels": b["kernels"], "delta_us": b["path_us"] - a["path_us"]}
              for a, b in zip(layer_overview(events, marker), layer_overview(other, marker))]
    return {"span_us": mine["span_us"], "other_span_us": theirs["span_us"], "kernels": mine["kernels"],
            "other_kernels": theirs["kernels"], "families": families, "layers": layers}


def print_comparison(comparison: dict, other_name: str) -> None:
    from dsflash_compile.benchmarking import print_table

    c = comparison
    print(f"\nagainst {other_name}: span {c['span_us']:.1f} -> {c['other_span_us']:.1f} us "
          f"({c['other_span_us'] - c['span_us']:+.1f}), kernels {c['kernels']} -> {c['other_kernels']}")
    print_table(c["families"], [("family", "family", ""), ("path us", "path_us", ".1f"),
                                ("other path us", "other_path_us", ".1f"), ("delta us", "delta_us", "+.1f")])
    print()
    print_table(c["layers"], [("layer", "layer", "d"), ("path us", "path_us", ".1f"),
                              ("other path us", "other_path_us", ".1f"), ("delta us", "delta_us", "+.1f"),
                              ("kernels", "kernels", "d"), ("other kernels", "other_kernels", "d")])


def model_floor_bytes(preset: str, batch: int, context: int, weights: str) -> dict:
    """benchmarking.decode_traffic's bytes per family for a preset, its model built on the meta device."""
    import torch

    from dsflash_compile import DeepseekV41ForCausalLM, preset_config
    from dsflash_compile.benchmarking import decode_traffic

    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(preset_config(preset, weights=weights))
    # compile() runs a bf16 MoE's shared expert in the routed kernels (CompileOptions.moe_shared_stacked)
    return decode_traffic(model, batch, context, shared_in_moe=weights == "bf16")["bytes"]


def print_summary(summary: dict, configs: int = 4) -> None:
    from dsflash_compile.benchmarking import print_table

    print_table(summary["families"] + [{"family": "total", "us": summary["busy_us"], "launches": summary["kernels"],
                                        "path_us": sum(row["path_us"] for row in summary["families"]),
                                        "floor_us": sum(row.get("floor_us", 0) for row in summary["families"])}],
                [("family", "family", ""), ("us", "us", ".1f"), ("launches", "launches", "d"),
                 ("us/launch", "us_per_launch", ".2f"), ("share", "share", ".1%"), ("path us", "path_us", ".1f"),
                 ("floor us", "floor_us", ".1f"), ("x floor", "vs_floor", ".2f"),
                 ("path x floor", "path_vs_floor", ".2f")])
    print(f"\n{summary['kernels']} kernels, busy {summary['busy_us']:.0f} us over a span of "
          f"{summary['span_us']:.0f} us: "
          f"idle {summary['idle_us']:.0f} us ({summary['launch_gap_us']:.0f} us in gaps < {HOST_GAP_US:.0f} us, "
          f"{summary['host_gap_us']:.0f} us in longer ones); {summary['graph_launches']} cudaGraphLaunch, "
          f"{summary['kernel_launches']} kernel launches from the host")
    for gap in summary["largest_gaps"]:
        print(f"  gap {gap['us']:8.1f} us before {gap['before']}")
    print("\nslowest launch configurations per family:")
    for fam in [row["family"] for row in summary["families"]]:
        for row in [c for c in summary["configs"] if c["family"] == fam][:configs]:
            print(f"  {fam:10s} {row['us']:8.1f} us {row['launches']:4d}x {row['us'] / row['launches']:6.1f} us "
                  f"grid {row['grid']:12s} {row['name']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--preset", help="compute each family's floor for this preset (else no floors)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--weights", choices=["native", "bf16"], default="bf16")
    parser.add_argument("--bandwidth", type=float, default=H200_COPY_BANDWIDTH,
                        help="bytes per second (default: the H200's measured copy bandwidth)")
    parser.add_argument("--configs", type=int, default=4, help="launch configurations listed per family")
    parser.add_argument("--out", help="write the summary as JSON here")
    parser.add_argument("--layer", type=int, help="also list this layer's kernels in order (marker to marker)")
    parser.add_argument("--marker", default="_router_kernel",
                        help="--layer: the kernel launched once a layer that starts one (a build with the router "
                             "inside the seam has no _router_kernel: _up_kernel)")
    parser.add_argument("--median", action="store_true",
                        help="--layer: each kernel's median over the layers launching the same kernels")
    parser.add_argument("--layers", action="store_true",
                        help="every layer's path, and the kernels it launches beyond the common layer's")
    parser.add_argument("--against", metavar="TRACE",
                        help="another trace of the step (a variant's): span, families' and layers' paths side by side")
    args = parser.parse_args(argv)
    floor_bytes = model_floor_bytes(args.preset, args.batch, args.context, args.weights) if args.preset else None
    events = load_events(args.trace)
    summary = summarize(events, floor_bytes, args.bandwidth)
    summary.update(trace=args.trace, preset=args.preset, batch=args.batch, context=args.context,
                   bandwidth=args.bandwidth, floor_bytes=floor_bytes)
    print_summary(summary, args.configs)
    if args.layer is not None:
        from dsflash_compile.benchmarking import print_table

        if args.median:
            rows, alike = layer_medians(events, args.marker, args.layer)
            which = f"layer {args.layer}, medians over the {alike} layers launching its kernels"
        else:
            rows, which = layer_kernels(events, args.marker, args.layer), f"layer {args.layer}"
        print(f"\n{which}: {sum(r['path_us'] for r in rows):.1f} us on the path, {len(rows)} kernels")
        print_table(rows, [("gap us", "gap_us", ".1f"), ("us", "us", ".1f"), ("path us", "path_us", ".1f"),
                           ("grid", "grid", ""), ("kernel", "name", "")])
    if args.layers:
        summary["layers"] = layer_overview(events, args.marker)
        print("\nlayer  path us  kernels  beyond the common layer's: path us, the largest")
        for row in summary["layers"]:
            largest = ", ".join(f"{name[:40]} {us:.1f}" for name, us in row["extra"])
            print(f"{row['layer']:5d} {row['path_us']:8.1f} {row['kernels']:8d} {row['extra_path_us']:8.1f}  {largest}")
    if args.against:
        summary["against"] = compare_traces(events, load_events(args.against), args.marker)
        print_comparison(summary["against"], args.against)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
