"""scripts/trace_summary.py on a small synthetic Chrome trace (no GPU, no model)."""

import gzip
import json

import pytest
import torch
from script_module import load_script

from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.benchmarking import decode_traffic


@pytest.fixture(scope="module")
def trace_summary():
    return load_script("trace_summary")


def kernel(name, ts, dur, grid=(1, 1, 1)):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"grid": list(grid)}}


EVENTS = [
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 10, "dur": 1},
    kernel("_seam_kernel", 511, 12, (1, 80, 1)),  # 500 us after the copy: the host
    kernel("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", 524, 6, (4, 15, 1)),  # 1 us launch gap
    kernel("void cublasLt::splitKreduce_kernel<32, 16>", 530, 2),
    kernel("_ZN7cutlass13device_kernelIN2at4cuda6detail25GroupProblemShape", 532, 60, (132, 1, 1)),
    kernel("_grouped_kernel", 592, 30, (6, 72, 1)),
    kernel("triton_poi_fused_add_0", 623, 1),
    kernel("triton_poi_fused_add_0", 624, 1),
    {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 3},
]


def test_families_idle_time_and_floors(trace_summary, tmp_path):
    summary = trace_summary.summarize(EVENTS, floor_bytes={"moe": 4.17e7, "gemm": 4.17e6}, bandwidth=4.17e12)
    rows = {row["family"]: row for row in summary["families"]}
    assert {f: (r["us"], r["launches"]) for f, r in rows.items()} == {
        "moe": (90, 2), "gemm": (8, 2), "mhc": (12, 1), "inductor": (2, 2), "memcpy": (1, 1)}
    assert [row["family"] for row in summary["families"]][:2] == ["moe", "mhc"]  # by time
    assert rows["moe"]["floor_us"] == pytest.approx(10) and rows["moe"]["vs_floor"] == pytest.approx(9)
    assert rows["gemm"]["vs_floor"] == pytest.approx(8) and "floor_us" not in rows["mhc"]
    assert summary["busy_us"] == 113 and summary["span_us"] == 615
    assert summary["host_gap_us"] == 500 and summary["launch_gap_us"] == pytest.approx(2)
    assert summary["graph_launches"] == 1 and summary["kernels"] == 8
    configs = [c for c in summary["configs"] if c["family"] == "gemm"]
    assert [(c["grid"], c["launches"]) for c in configs] == [("[4, 15, 1]", 1), ("[1, 1, 1]", 1)]


def test_main_reads_gzip_and_writes_json(trace_summary, tmp_path, capsys):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    trace_summary.main([str(path), "--out", str(tmp_path / "summary.json")])
    out = capsys.readouterr().out
    assert "moe" in out and "1 cudaGraphLaunch" in out
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["busy_us"] == 113 and written["floor_bytes"] is None


def test_main_lists_a_layer_from_another_marker(trace_summary, tmp_path, capsys):
    """--marker: layers from the up kernel to the next (a build without the router's own launch)."""
    path = tmp_path / "trace.json"
    events = [kernel("_up_kernel", 0, 80), kernel("_seam_kernel", 81, 9), kernel("_up_kernel", 100, 80)]
    path.write_text(json.dumps({"traceEvents": events}))
    trace_summary.main([str(path), "--layer", "0", "--marker", "_up_kernel"])
    out = capsys.readouterr().out
    assert "layer 0: 90.0 us on the path, 2 kernels" in out and "_seam_kernel" in out


def test_layer_kernels_lists_one_layer_in_order(trace_summary):
    """Router to router: each kernel with the idle gap before it and its share of the span (the seam started
    early, inside the up kernel: only its end past the up kernel's counts); too few routers is a clear error."""
    events = [kernel("_router_kernel", 0, 7), kernel("_up_kernel", 8, 80), kernel("_seam_kernel", 85, 9),
              kernel("_router_kernel", 100, 7), kernel("_up_kernel", 107, 80), kernel("_router_kernel", 200, 7)]
    rows = trace_summary.layer_kernels(events, index=0)
    assert [(r["name"], r["us"], r["gap_us"], r["path_us"]) for r in rows] == [
        ("_router_kernel", 7, 0.0, 7), ("_up_kernel", 80, 1, 81), ("_seam_kernel", 9, 0.0, 6)]
    assert [r["name"] for r in trace_summary.layer_kernels(events, index=1)] == ["_router_kernel", "_up_kernel"]
    with pytest.raises(ValueError, match="3 launches of _router_kernel; layer 2 needs 4"):
        trace_summary.layer_kernels(events, index=2)


def test_layer_medians_over_the_layers_launching_the_same_kernels(trace_summary):
    """Each kernel's figures are the median over the layers with the same kernel sequence (here layers 0, 1 and
    3; layer 2 launches another kernel and is left out)."""
    events, ts = [], 0
    for seam, extra in ((9, False), (5, False), (30, True), (7, False)):
        events += [kernel("_router_kernel", ts, 7), kernel("_up_kernel", ts + 7, 80)]
        events += [kernel("_other_kernel", ts + 87, 3)] if extra else []
        events.append(kernel("_seam_kernel", ts + 90, seam))
        ts += 200
    events.append(kernel("_router_kernel", ts, 7))
    rows, alike = trace_summary.layer_medians(events, index=1)
    assert alike == 3
    # the routers' path shares 7, 108 and 87 (each from the end of the layer before); the seams' 12, 8 and 10
    assert [(r["name"], r["us"], r["path_us"]) for r in rows] == [
        ("_router_kernel", 7, 87), ("_up_kernel", 80, 80), ("_seam_kernel", 7, 10)]
    assert [r["gap_us"] for r in rows] == [0.0, 0.0, 3.0]


def test_layer_overview_lists_what_a_layer_launches_beyond_the_common_one(trace_summary, tmp_path, capsys):
    """Every layer's path and kernels; beyond the common sequence (router, up, seam: layers 0, 1, 3) layer 2's two
    extra launches, the largest first, counted by name (a second _up_kernel is extra too)."""
    events, ts = [], 0
    for extra in ((), (), (("_other_kernel", 3), ("_up_kernel", 5)), ()):
        events += [kernel("_router_kernel", ts, 7), kernel("_up_kernel", ts + 7, 80)]
        at = ts + 87
        for name, dur in extra:
            events.append(kernel(name, at, dur))
            at += dur
        events.append(kernel("_seam_kernel", at, 10))
        ts += 200
    events.append(kernel("_router_kernel", ts, 7))
    overview = trace_summary.layer_overview(events)
    assert [(row["layer"], row["kernels"], row["extra_path_us"]) for row in overview] == [
        (0, 3, 0.0), (1, 3, 0.0), (2, 5, 8.0), (3, 3, 0.0)]
    assert overview[2]["extra"] == [("_up_kernel", 5.0), ("_other_kernel", 3.0)]
    assert overview[1]["path_us"] == pytest.approx(200)  # from layer 0's last end (97) to its own (297)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    trace_summary.main([str(path), "--layers", "--out", str(tmp_path / "summary.json")])
    assert "_other_kernel 3.0" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "summary.json").read_text())["layers"]) == 4


def test_path_shares_add_up_to_the_span_when_kernels_overlap(trace_summary):
    """Programmatic dependent launch: a kernel starts while the one before it runs and waits, so durations overlap.
    Each kernel's path share is its end minus the latest end before it; a kernel ending inside another adds 0."""
    events = [kernel("_seam_kernel", 0, 8), kernel("_bf16_linear_kernel", 2, 20),  # started early, waited 6 us
              kernel("triton_poi_fused_add_0", 5, 3), kernel("_router_kernel", 22, 5)]  # ends inside the GEMV
    device = trace_summary.device_events(events)
    assert trace_summary.path_shares(device) == [8, 14, 0, 5]
    summary = trace_summary.summarize(events, floor_bytes={"gemm": 4.17e7}, bandwidth=4.17e12)
    rows = {row["family"]: row for row in summary["families"]}
    assert {f: (r["us"], r["path_us"]) for f, r in rows.items()} == {
        "gemm": (20, 14), "mhc": (8, 8), "router": (5, 5), "inductor": (3, 0)}
    assert sum(r["path_us"] for r in rows.values()) == summary["span_us"] == 27
    assert rows["gemm"]["vs_floor"] == pytest.approx(2) and rows["gemm"]["path_vs_floor"] == pytest.approx(1.4)



def test_floor_bytes_put_the_stacked_shared_expert_with_the_moe(trace_summary):
    """bf16 weights: compile() stacks the shared expert into the routed kernels, so trace_summary counts its bytes
    as moe, not gemm; the total stays the same."""
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(preset_config("tiny", weights="bf16"))
    apart = decode_traffic(model, 1, 64)["bytes"]
    stacked = trace_summary.model_floor_bytes("tiny", 1, 64, "bf16")
    shared = sum(t.numel() * t.element_size() for name, t in model.state_dict().items()
                 if ".ffn.shared_experts." in name)
    assert shared and stacked["moe"] == apart["moe"] + shared and stacked["gemm"] == apart["gemm"] - shared
    assert sum(stacked.values()) == sum(apart.values())


def test_against_another_trace_sets_families_and_layers_side_by_side(trace_summary, tmp_path, capsys):
    """--against: a variant's trace where layer 1's seam takes 4 us less and a compressor kernel of 2 us replaces an
    Inductor one of 5: the span 7 us shorter, each family's and layer's path difference."""
    def step(seam, extra):
        events, ts = [], 0
        for layer in range(3):
            events += [kernel("_router_kernel", ts, 7), kernel("_seam_kernel", ts + 7, seam if layer == 1 else 10)]
            ts += 7 + (seam if layer == 1 else 10)
            if layer == 1:
                events.append(kernel(extra[0], ts, extra[1]))
                ts += extra[1]
        return events + [kernel("_router_kernel", ts, 7)]

    base, variant = step(10, ("triton_red_fused_softmax_0", 5)), step(6, ("_compress_token_kernel", 2))
    c = trace_summary.compare_traces(base, variant)
    assert c["other_span_us"] - c["span_us"] == pytest.approx(-7)
    deltas = {row["family"]: row["delta_us"] for row in c["families"]}
    assert deltas["mhc"] == pytest.approx(-4) and deltas["inductor"] == pytest.approx(-5)
    assert deltas["compressor"] == pytest.approx(2) and deltas["router"] == pytest.approx(0)
    assert [round(row["delta_us"], 3) for row in c["layers"]] == [0.0, -7.0, 0.0]
    paths = [tmp_path / "base.json", tmp_path / "variant.json"]
    for path, events in zip(paths, (base, variant)):
        path.write_text(json.dumps(events))
    trace_summary.main([str(paths[0]), "--against", str(paths[1])])
    assert "(-7.0)" in capsys.readouterr().out
