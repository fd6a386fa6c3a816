"""`dsflash bench serve` / `bench plot` / `bench <script>` on the CPU: the whole serve pipeline on `tiny` with a
tiny workload, both configurations (the optimized one compiled with the "eager" backend: Dynamo graphs and
guards, no code generation), its JSON and PNG; the headline's interpolation; the CLI's errors."""

import argparse
import json

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

from dsflash_compile import cli
from dsflash_compile.serve_bench import (
    add_arguments,
    check_arguments,
    ratio_bound,
    throughput_at,
)

SERVE = ["bench", "serve", "--preset", "tiny", "--device", "cpu", "--concurrency", "1", "2", "--turns", "2",
         "--max-new-tokens", "4", "--scale", "1/128", "--backend", "eager", "--prefill-buckets", "32",
         "--batch-buckets", "2", "--profile", "2", "--profile-configs", "optimized"]
# one batch bucket and one prefill bucket: the fewest graphs to trace; one profiled concurrency of one config
# (listing a profile's CPU operators took ~20 s each)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One run for the module (tracing the graphs takes most of its ~20 s). compile() changes Inductor
    settings (restored here); one thread, since OpenMP threads spin-waiting on shared cores make tiny ops
    slow by 10-100x."""
    out, threads = tmp_path_factory.mktemp("serve"), torch.get_num_threads()
    torch._dynamo.reset()
    counters.clear()
    torch.set_num_threads(1)
    try:
        with inductor_config.patch(post_grad_custom_post_pass=inductor_config.post_grad_custom_post_pass,
                                   online_softmax=inductor_config.online_softmax,
                                   emulate_precision_casts=inductor_config.emulate_precision_casts):
            # in two processes' worth: day-zero, then optimized resuming its JSON (as on the GPU, where
            # each fits a per-command time limit)
            assert cli.main([*SERVE, "--configs", "day-zero", "--out", str(out / "first")]) == 0
            [first] = (out / "first").glob("serve-tiny-*.json")
            assert cli.main([*SERVE, "--configs", "optimized", "--resume", str(first), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    [path] = out.glob("serve-tiny-*.json")
    return path


def test_results_hold_both_curves_per_request_records_and_headlines(served):
    result = json.loads(served.read_text())
    for key in ("command", "date", "device", "commit", "torch", "batching", "max_length", "options"):
        assert key in result
    assert "lockstep" in result["batching"]
    assert result["workload"]["sessions"] == 2 and 0 < result["workload"]["prefix_hit_rate"] <= 1
    assert set(result["configs"]) == {"day-zero", "optimized"}
    [first] = (served.parent / "first").glob("serve-tiny-*.json")  # the day-zero run, resumed
    assert result["configs"]["day-zero"]["concurrency"] == json.loads(first.read_text())["configs"]["day-zero"]["concurrency"]
    assert all(entry["run"]["commit"] for entry in result["configs"].values())
    for name, entry in result["configs"].items():
        assert set(entry["concurrency"]) == {"1", "2"}
        for c, point in entry["concurrency"].items():
            assert "error" not in point, point.get("error")
            assert point["turns"] == 2 and point["requests"] == 2 * int(c) == len(point["records"])
            assert point["generated_tokens"] == sum(r["new_tokens"] for r in point["records"])
            assert point["tokens_s_per_gpu"] > 0
            for key in ("ttft_s", "tpot_s", "tokens_s_per_user", "prompt_tokens"):
                assert point[key]["p50"] > 0 and point[key]["p90"] >= point[key]["p50"]
            for record in point["records"]:
                assert 1 <= record["new_tokens"] <= 4 and record["ttft_s"] > 0
            if c == "2" and name == "optimized":  # --profile 2 --profile-configs optimized
                assert point["profile"]["kernels"] > 0 and len(point["profile"]["top"]) == 10
            else:
                assert "profile" not in point
            # a session's second prompt is its first + the answer + new text
            first, second = (r for r in point["records"] if r["session"] == 0)
            assert second["prompt_tokens"] > first["prompt_tokens"] + first["new_tokens"]
    for point in result["configs"]["optimized"]["concurrency"].values():
        assert point["prefix_cache"]["hits"] > 0  # the system prefix, then each session's previous turn
        assert point["graphs_compiled_while_timed"] == 0
    head = result["headline"]
    assert head["lowest_concurrency"] == 1
    assert head["ttft_speedup_p50"] > 0 and head["tpot_speedup_p50"] > 0
    day_zero_speeds = [p["tokens_s_per_user"]["p50"] for p in result["configs"]["day-zero"]["concurrency"].values()]
    assert head["tokens_s_per_user_constraint"] in day_zero_speeds
    assert head["day-zero_tokens_s_per_gpu_at_constraint"] > 0
    ratio = head["throughput_ratio_at_constraint"]  # None when the optimized curve never reaches that speed
    assert ratio is None or ratio > 0


def test_plot_is_written_and_remade_from_the_json(served, tmp_path):
    assert served.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png = tmp_path / "again.png"
    assert cli.main(["bench", "plot", str(served), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_names_what_differs(served, tmp_path):
    with pytest.raises(ValueError, match="differs from this one in max_length, workload, --turns, --max-new-tokens"):
        cli.main(["bench", "serve", "--preset", "tiny", "--device", "cpu", "--concurrency", "1", "--turns", "1",
                  "--scale", "1/64", "--configs", "optimized", "--resume", str(served), "--out", str(tmp_path)])


def test_throughput_at_a_per_user_speed_interpolates_and_flags_the_curve_end():
    points = [(1, 100.0, 100.0), (8, 50.0, 400.0), (64, 10.0, 640.0)]  # (C, tokens/s per user, per GPU)
    assert throughput_at(points, 75.0) == (250.0, False)  # halfway between C=1 and C=8
    assert throughput_at(points, 50.0) == (400.0, False)
    assert throughput_at(points, 5.0) == (640.0, True)  # every point is fast enough: a lower bound
    assert throughput_at(points, 200.0) == (None, False)


def test_the_throughput_ratio_says_which_curve_ends_still_fast_enough():
    def says(base, fast):
        return ratio_bound({"day-zero_is_lower_bound": base, "optimized_is_lower_bound": fast})
    assert says(False, False) == ""
    assert "at least" in says(False, True) and "at most" in says(True, False)
    assert "not a bound" in says(True, True)  # the 11-30 e H200 run: both still met 1.1 tokens/s per user at C=64


def test_profile_defaults_to_the_lowest_and_highest_concurrency():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--concurrency", "4", "1", "2", "--device", "cpu"])
    check_arguments(args)
    assert args.profile == [1, 4]
    args = parser.parse_args(["--concurrency", "1", "2", "--profile", "--device", "cpu"])
    check_arguments(args)
    assert args.profile == []


def test_cli_parses_bench_commands_and_names_bad_input(capsys, monkeypatch):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "serve", "--help"])
    assert done.value.code == 0 and "lockstep" in capsys.readouterr().out.lower()
    with pytest.raises(SystemExit) as done:  # the script's own --help, passed through
        cli.main(["bench", "attention", "--help"])
    assert done.value.code == 0 and "--quick" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:  # distributed: each torchrun process runs `dsflash bench parallel`
        cli.main(["bench", "parallel", "--help"])
    assert done.value.code == 0 and "--baseline" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "serve", "--concurrency", "1", "4", "--sessions", "2"])
    assert done.value.code == 2 and "--concurrency 4 is more than --sessions 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "serve", "--concurrency", "1", "2", "--profile", "4", "--device", "cpu"])
    assert done.value.code == 2 and "profile only concurrencies that run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "plot", "missing.json"])
    assert done.value.code == 2 and "missing.json is not a file" in capsys.readouterr().err
    monkeypatch.setitem(cli.BENCH_SCRIPTS, "mhc", ("not_there.py", "gone"))
    with pytest.raises(SystemExit, match="ship with the source checkout"):
        cli.main(["bench", "mhc"])
