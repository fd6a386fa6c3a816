"""scripts/replay_accuracy.py on the tiny preset (CPU): its chunked teacher forcing and grouped experts against
token-by-token runs of the model as built; its control (a two-chunk prefill: exact in math, its rounding
allowed); its metrics and rows."""

import json

import pytest
import torch

from dsflash_compile.presets import preset_model
from script_module import load_script


@pytest.fixture(scope="module")
def replay_accuracy():
    return load_script("replay_accuracy")


def token_by_token(model, prompts, new_tokens, replay, feed=None):
    """(tokens [B, N], fp32 log-probs [B, N, V]): greedy decoding, or fed `feed`, one token per forward in a
    cache of its own (the measurement as first written)."""
    model.model.text_config.swa_bounded_replay = replay
    cache = model.new_cache(prompts.shape[0], prompts.shape[1] + new_tokens)
    logits = model(prompts, cache=cache, logits_to_keep=1).logits[:, -1]
    tokens, logprobs = [], []
    for t in range(new_tokens):
        logprobs.append(torch.log_softmax(logits.float(), -1))
        tokens.append(logits.argmax(-1) if feed is None else feed[:, t])
        if t + 1 < new_tokens:
            logits = model(tokens[-1][:, None], cache=cache).logits[:, -1]
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


@torch.no_grad()
@pytest.mark.parametrize("length", [12, 40])  # within the window (16): exact; beyond it: trimmed
def test_runs_equal_the_token_by_token_runs(replay_accuracy, length):
    """run(): one prefill per setting (its cache saved, then put back for the forced tokens, fed as one chunk),
    grouped experts: the greedy tokens of separate token-by-token runs of the model as built (the expert loop),
    and their log-probs but for the fp32 head's rounding of a chunk (its GEMM's blocking follows the rows)."""
    batch, new_tokens = 3, 5
    loop, grouped = preset_model("tiny"), preset_model("tiny")
    replay_accuracy.prepare(grouped)
    assert not loop.model.layers[0].ffn.grouped and grouped.model.layers[0].ffn.grouped
    prompts = torch.randint(3, 512, (batch, length), generator=torch.Generator().manual_seed(length))
    exact, exact_logprobs = token_by_token(loop, prompts, new_tokens, replay=False)
    replayed, _ = token_by_token(loop, prompts, new_tokens, replay=True)
    _, forced = token_by_token(loop, prompts, new_tokens, replay=True, feed=exact)
    tokens_off, logprobs_off = replay_accuracy.run(grouped, prompts, new_tokens, replay=False)
    tokens_on, logprobs_on = replay_accuracy.run(grouped, prompts, new_tokens, replay=True, forced=exact)
    assert torch.equal(tokens_off, exact) and torch.equal(tokens_on, replayed)
    for got, want in ((logprobs_off, exact_logprobs), (logprobs_on, forced)):
        assert torch.equal(got[:, 0], want[:, 0])  # the prefill's
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    metrics = replay_accuracy.summarize(replay_accuracy.compare(grouped, prompts, new_tokens), [0.1])
    window = grouped.model.text_config.sliding_window
    if length <= window:  # both settings run the same computation; no control
        assert torch.equal(logprobs_on, logprobs_off) and torch.equal(tokens_on, tokens_off)
        assert metrics["teacher_forced_argmax_agreement"] == metrics["greedy_all_tokens_equal"] == 1.0
        assert metrics["mean_kl"] == metrics["max_kl"] == 0.0
        assert "control_mean_kl" not in metrics
    else:
        assert not torch.equal(logprobs_on, logprobs_off) and metrics["max_kl"] > 0.0
        # the control: the same math in other chunk shapes (here bit for bit; allowed their rounding), far
        # closer to replay off than replay on is
        tokens_ctl, logprobs_ctl = replay_accuracy.run(grouped, prompts, new_tokens, replay=False, forced=exact,
                                                       split=length - window)
        assert torch.equal(tokens_ctl, tokens_off)
        torch.testing.assert_close(logprobs_ctl, logprobs_off, rtol=0, atol=1e-5)
        assert metrics["control_teacher_forced_argmax_agreement"] == metrics["control_greedy_all_tokens_equal"] == 1.0
        # (mean, not max: in the committed 100-prompt run one control position reached 0.16 of replay's max KL)
        assert metrics["control_max_margin_flipped"] is None and metrics["control_mean_kl"] <= metrics["mean_kl"] / 10


def test_main_writes_a_row_per_length(replay_accuracy, tmp_path, monkeypatch):
    """Three prompts in batches of two (one partial batch) per length; the untrimmed length is exact; the control
    (two prefill chunks against one) below replay's own deviation (a tenth of it where BLAS rounds a GEMM alike
    for any row count; a third on the AMX machine of 12-04)."""
    monkeypatch.setattr("sys.argv", ["replay_accuracy.py", "--prompts", "3", "--lengths", "12", "24", "--new-tokens",
                                     "3", "--batch", "2", "--out", str(tmp_path)])
    replay_accuracy.main()
    rows = json.loads(next(tmp_path.glob("replay-accuracy-*.json")).read_text())["rows"]
    assert [(r["prompt_len"], r["prompts"], r["new_tokens"], r["trimmed"]) for r in rows] == [(12, 3, 3, False),
                                                                                            (24, 3, 3, True)]
    assert rows[0]["mean_kl"] == rows[0]["max_kl"] == 0.0 and rows[0]["greedy_token_agreement"] == 1.0
    assert "control_mean_kl" not in rows[0] and rows[1]["control_mean_kl"] < rows[1]["mean_kl"]
    for row in rows:
        assert 0.0 <= row["teacher_forced_argmax_agreement"] <= 1.0 and row["max_kl"] >= row["mean_kl"] >= 0.0
        assert 0.0 <= row["margin_p10"] <= row["margin_median"] < float("inf")
        assert 1.0 >= row["share_margin_over_0.01"] >= row["share_margin_over_0.1"] >= row["share_margin_over_1"]
        for t in ("0.01", "0.1", "1"):  # None: no position has that margin
            agreement = row[f"teacher_forced_argmax_agreement_margin_over_{t}"]
            assert agreement is None or 0.0 <= agreement <= 1.0


def test_summarize_known_positions(replay_accuracy):
    """Two prompts of three tokens: the margins' statistics, the agreement above each margin, the largest margins
    of the flips (prompt 0 first diverges at token 1), and a setting without a control."""
    positions = {"margin": torch.tensor([[0.5, 0.01, 2.0], [0.2, 0.3, 0.05]]),
                 "agrees": torch.tensor([[True, False, True], [True, True, False]]),
                 "kl": torch.tensor([[0.0, 0.3, 0.0], [0.0, 0.0, 0.1]]),
                 "differs": torch.tensor([[False, True, True], [False, False, False]])}
    row = replay_accuracy.summarize(positions, [0.04, 1.0, 3.0])
    assert row["margin_median"] == pytest.approx(0.2) and row["margin_p10"] == pytest.approx(0.03)
    assert [row[f"share_margin_over_{t}"] for t in ("0.04", "1", "3")] == pytest.approx([5 / 6, 1 / 6, 0.0])
    agreement = [row[f"teacher_forced_argmax_agreement_margin_over_{t}"] for t in ("0.04", "1", "3")]
    assert agreement[0] == pytest.approx(0.8) and agreement[1:] == [1.0, None]
    assert row["max_margin_flipped"] == pytest.approx(0.05)
    assert row["max_margin_first_divergence"] == pytest.approx(0.01)
    assert row["mean_first_divergence"] == 2.0 and row["greedy_all_tokens_equal"] == 0.5
    assert row["mean_kl"] == pytest.approx(0.4 / 6) and row["max_kl"] == pytest.approx(0.3)
    assert not any(key.startswith("control_") for key in row)
