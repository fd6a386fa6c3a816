"""Prefix-cache hits, the part that touches the model (tiny preset, CPU): a restored prefix of H tokens and
the replay of tokens [H - W, H) that rebuilds the window rings (dsflash_compile/prefix_state.py)."""

import pytest
import torch

from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.prefix_state import restore, snapshot

H, L = 32, 60  # prefix (a multiple of the ratios, longer than tiny's 16-token window) and prompt lengths


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return DeepseekV41ForCausalLM(preset_config("tiny", swa_bounded_replay=False)).eval()


def prompt(length=L, seed=0):
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def prefill(model, ids, max_length=64):
    cache = model.new_cache(1, max_length)
    model(ids, cache=cache)
    return cache


@torch.no_grad()
def test_hit_restores_the_prefix_and_replays_the_last_window(tiny):
    """After restore + run(replay_from=H) over tokens [H - W, L): the restored compressed rows and index keys
    are the prefill's bit for bit (the replayed tokens recompute them differently, so they must not be
    rewritten), the rows from H on are written, every query's window starts at H - W, and the row's length
    is L; decoding then works."""
    window = tiny.model.text_config.sliding_window
    ids = prompt()
    full = prefill(tiny, ids[:, :H])
    state = snapshot(full, 0, H)
    history = prefill(tiny, ids[:, :H - window]).engram_history[0]
    seen = {}
    hook = tiny.model.layers[0].register_forward_pre_hook(lambda block, args: seen.update(idx=args[2].window_idx))

    cache = tiny.new_cache(1, 64)
    restore(cache, 0, state, history)
    hidden = tiny.model.run(ids[:, H - window:], torch.ones(1, L - H + window, dtype=torch.long), cache, L,
                            replay_from=torch.tensor([H]))
    hook.remove()
    assert hidden.shape == (1, L - H + window, tiny.model.text_config.hidden_size)
    assert cache.lengths[0].item() == L
    for role in tiny.model.text_config.layer_roles:
        if role.is_kv_source:
            kept = H // role.ratio
            assert torch.equal(cache.compressed[role.layer][0, :kept], full.compressed[role.layer][0, :kept])
            assert torch.equal(cache.index_keys[role.layer][0, :kept], full.index_keys[role.layer][0, :kept])
            assert bool(cache.compressed[role.layer][0, kept:L // role.ratio].ne(0).any(-1).all())
    valid = seen["idx"][0] >= 0  # query i (position H - W + i) sees keys H - W .. H - W + i of this chunk
    assert valid.sum(-1).tolist() == [min(i + 1, window) for i in range(L - H + window)]
    assert bool((seen["idx"][0][valid] >= window).all())

    cache.seen_columns = L
    step = tiny(ids[:, -1:], cache=cache).logits
    assert step.shape == (1, 1, tiny.model.text_config.vocab_size) and bool(step.isfinite().all())


@torch.no_grad()
def test_replayed_tokens_would_rewrite_the_prefix_without_the_floor(tiny):
    """Why the write floor exists: replaying [H - W, H) with a truncated window gives other compressed rows
    for those tokens than the full prefill did."""
    window = tiny.model.text_config.sliding_window
    ids = prompt()
    full = prefill(tiny, ids[:, :H])
    cache = tiny.new_cache(1, 64)
    restore(cache, 0, snapshot(full, 0, H), prefill(tiny, ids[:, :H - window]).engram_history[0])
    tiny.model.run(ids[:, H - window:H], torch.ones(1, window, dtype=torch.long), cache, H)  # no replay_from
    layer, ratio = next((r.layer, r.ratio) for r in tiny.model.text_config.layer_roles if r.is_kv_source)
    replayed = slice((H - window) // ratio, H // ratio)
    assert not torch.equal(cache.compressed[layer][0, replayed], full.compressed[layer][0, replayed])


def test_prefix_lengths_are_checked(tiny):
    cache = prefill(tiny, prompt(40))
    with pytest.raises(ValueError, match="multiple of 2"):
        snapshot(cache, 0, 33)
    with pytest.raises(ValueError, match="longer than the window"):
        snapshot(cache, 0, 16)
    with pytest.raises(ValueError, match="holds only 40"):
        snapshot(cache, 0, 48)
