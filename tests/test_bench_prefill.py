"""scripts/bench_prefill.py's timing rounds (no model): variants take turns, the first round untimed; an
optional variant that fails there is dropped with its error, any other failure raises; medians and spreads."""

import pytest
from script_module import load_script

bench_prefill = load_script("bench_prefill")


def test_rounds_take_turns_and_drop_only_an_optional_failure():
    calls = []

    def variant(name, seconds):
        def run():
            calls.append(name)
            return seconds
        return run

    def capture_fails():
        calls.append("graphs")
        raise RuntimeError("capture")

    times, errors = bench_prefill.rounds({"off": variant("off", 2.0), "graphs": capture_fails,
                                          "on": variant("on", 1.0)}, repeats=2, optional=("graphs",))
    assert calls == ["off", "graphs", "on"] + ["off", "on"] * 2  # in turn; the failed one never again
    assert times == {"off": [2.0, 2.0], "on": [1.0, 1.0]} and errors == {"graphs": "RuntimeError('capture')"}
    with pytest.raises(RuntimeError, match="capture"):  # not optional: the error is the run's
        bench_prefill.rounds({"off": capture_fails}, repeats=1)
    assert bench_prefill.rounds({"off": variant("off", 3.0)}, repeats=0) == ({"off": [3.0]}, {})


def test_summary_is_the_median_with_its_spread():
    row = {}
    bench_prefill.summarize(row, "ttft_replay_off_s", [3.0, 1.0, 2.0])
    bench_prefill.summarize(row, "ttft_replay_on_s", [1.0, 1.5, 1.0])
    assert row == {"ttft_replay_off_s": 2.0, "ttft_replay_off_spread_s": [1.0, 3.0],
                   "ttft_replay_on_s": 1.0, "ttft_replay_on_spread_s": [1.0, 1.5]}
    assert bench_prefill.spread(row) == 1.0  # (3 - 1) / 2 beats (1.5 - 1) / 1
