"""Benchmark helpers that run anywhere (dsflash_compile/benchmarking.py)."""

from dsflash_compile.benchmarking import print_table


def test_print_table_aligns_scales_and_marks_missing_values(capsys):
    print_table([{"n": 1, "t": 2.5e-5}, {"n": 64, "t": None}, {"n": 8, "t": float("nan")}],
                [("tokens", "n", "d"), ("time us", "t", ".1f", 1e6), ("other", "x", ".2f")])
    assert capsys.readouterr().out.splitlines() == ["tokens time us other",
                                                    "     1    25.0     -",
                                                    "    64       -     -",
                                                    "     8       -     -"]
