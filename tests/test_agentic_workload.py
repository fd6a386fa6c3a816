"""The synthetic agentic workload (dsflash_compile/agentic_workload.py): reproducible, prompts that extend
the previous turn, a shared system prefix, AgentX-like statistics."""

import pytest

from dsflash_compile.agentic_workload import WorkloadConfig, make_workload, workload_stats


def test_workload_is_reproducible_and_prompts_extend_the_previous_turn():
    config = WorkloadConfig(sessions=4, median_turns=6, scale=1 / 64, vocab_size=512)
    sessions = make_workload(config)
    assert [s.first for s in sessions] == [s.first for s in make_workload(config)]
    assert [s.first for s in sessions] != [s.first for s in make_workload(WorkloadConfig(
        sessions=4, median_turns=6, scale=1 / 64, vocab_size=512, seed=1))]
    system = round(16384 / 64)
    assert all(s.first[:system] == sessions[0].first[:system] for s in sessions)  # one shared prefix
    for session in sessions:
        prompts = session.planned_prompts()
        assert session.turns[0].new_tokens == [] and prompts[0] == session.first
        for i in range(1, len(prompts)):
            answer = [3] * session.turns[i - 1].output_len
            assert prompts[i] == prompts[i - 1] + answer + session.turns[i].new_tokens
        assert all(0 <= t < 512 for t in session.first)


def test_default_shape_matches_the_agentx_statistics():
    """Medians near the configured ones and > 90% prefix hits (BENCHMARKS.md), at 1/64 of the lengths."""
    config = WorkloadConfig(sessions=32, scale=1 / 64)
    stats = workload_stats(config, make_workload(config))
    assert stats["requests"] == sum(len(s.turns) for s in make_workload(config))
    assert 30 <= stats["turns"]["p50"] <= 60
    assert 4 <= stats["output_tokens"]["p50"] <= 10  # 444 / 64
    assert stats["input_tokens"]["p50"] > 10 * stats["output_tokens"]["p50"]  # long prompts, short answers
    assert stats["prefix_hit_rate"] > 0.9


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="median_turns"):
        WorkloadConfig(median_turns=0)
    with pytest.raises(ValueError, match="scale"):
        WorkloadConfig(scale=2)
