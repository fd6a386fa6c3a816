"""Benchmark helpers that run anywhere (dsflash_compile/benchmarking.py)."""

import torch

from dsflash_compile.benchmarking import fastest, print_table, profile_summary


def test_print_table_aligns_scales_and_marks_missing_values(capsys):
    print_table([{"n": 1, "t": 2.5e-5}, {"n": 64, "t": None}, {"n": 8, "t": float("nan")}],
                [("tokens", "n", "d"), ("time us", "t", ".1f", 1e6), ("other", "x", ".2f")])
    assert capsys.readouterr().out.splitlines() == ["tokens time us other",
                                                    "     1    25.0     -",
                                                    "    64       -     -",
                                                    "     8       -     -"]


def test_profile_summary_counts_what_a_step_ran(tmp_path):
    x = torch.randn(64, 64)
    summary = profile_summary(lambda: (x @ x).relu().sum(), str(tmp_path / "trace.json"), top=2)
    assert summary["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert summary["kernels"] >= 3 and summary["wall_us"] > 0 and len(summary["top"]) == 2
    assert summary["comm_us"] == 0  # no collectives (the parallel bench's CPU test sees some)
    assert (tmp_path / "trace.json").stat().st_size > 0


def test_fastest_keeps_the_timed_variants_that_agree():
    rows = [{"v": "slow", "agrees": True, "s": 2.0}, {"v": "wrong", "agrees": False, "s": 0.5},
            {"v": "failed", "agrees": False, "error": "out of resources"}, {"v": "fast", "agrees": True, "s": 1.0}]
    assert [r["v"] for r in fastest(rows)] == ["fast", "slow"]
