"""scripts/probe_decode_launch.py's host clock on the CPU (the step's timings need a GPU)."""

import time

from script_module import SCRIPTS, load_script

from dsflash_compile.piecewise_graph import PiecewiseGraph


class Piece:
    def replay(self):
        time.sleep(0.002)


def test_launch_clock_times_each_piece_and_the_work_before_the_first(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the script imports compile_and_profile's helpers
    probe = load_script("probe_decode_launch")
    graph = PiecewiseGraph(pool=None)
    graph.graphs = [Piece(), Piece(), Piece()]
    original = PiecewiseGraph.replay
    with probe.LaunchClock() as clock:
        clock.call_start = time.perf_counter()
        time.sleep(0.003)  # the runner's work before its first launch
        graph.replay()
        elapsed = time.perf_counter() - clock.call_start
    assert PiecewiseGraph.replay is original
    assert len(clock.times) == 1 and len(clock.times[0]) == 3 and min(clock.times[0]) >= 0.002
    assert len(clock.before_first) == 1 and clock.before_first[0] >= 0.003
    assert clock.before_first[0] + sum(clock.times[0]) <= elapsed  # the parts do not overlap
