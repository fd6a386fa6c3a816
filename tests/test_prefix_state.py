"""Prefix-cache hits, the part that touches the model (tiny preset, CPU): a restored prefix of H tokens and
the replay of tokens [H - W, H) that rebuilds the window rings (dsflash_compile/prefix_state.py)."""

import pytest
import torch

from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.prefix_cache import PrefixCache
from dsflash_compile.prefix_state import PrefixState, restore, snapshot
from test_model import left_pad

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


def fake_state(length, nbytes_per_token=4):
    """A PrefixState of `length` tokens: one ratio-1 source whose rows hold nbytes_per_token bytes."""
    rows = torch.arange(length * nbytes_per_token, dtype=torch.uint8).view(length, nbytes_per_token)
    return PrefixState(length, {5: rows}, {5: rows[:, :0]})


def test_store_hits_the_longest_cached_prefix_beyond_the_window():
    store = PrefixCache(block_size=16, window=16, budget_bytes=10_000)
    tokens = list(range(100))
    assert store.lookup(tokens) is None  # empty: a miss
    assert store.insert(tokens, fake_state(64))
    hit = store.lookup(tokens)  # 100 tokens: the 64 cached ones
    assert hit.length == 64 and torch.equal(hit.compressed[5], fake_state(64).compressed[5])
    shorter = store.lookup(tokens[:40])  # a shorter prompt: the entry serves its 32-token prefix
    assert shorter.length == 32 and torch.equal(shorter.compressed[5], fake_state(64).compressed[5][:32])
    assert store.lookup(tokens[:20]) is None  # one block = the window: not used
    assert store.lookup([7] + tokens[1:]) is None  # another first block: nothing shared
    assert (store.stats.hits, store.stats.misses, store.stats.hit_tokens) == (2, 3, 96)


def test_store_evicts_least_recently_used_within_its_budget():
    store = PrefixCache(block_size=16, window=16, budget_bytes=3 * 64 * 4)  # three 64-token states
    prompts = [[p] * 64 for p in range(4)]
    for p in prompts[:3]:
        assert store.insert(p, fake_state(64))
    assert store.lookup(prompts[0]) is not None  # prompt 0 is now the most recently used
    store.insert(prompts[3], fake_state(64))  # evicts prompt 1, the least recently used
    assert store.stats.evictions == 1 and store.nbytes == 3 * 64 * 4
    assert store.lookup(prompts[1]) is None
    assert all(store.lookup(prompts[p]) is not None for p in (0, 2, 3))
    assert not store.insert([9] * 1024, fake_state(1024))  # larger than the whole budget: not kept
    with pytest.raises(ValueError, match="whole blocks"):
        store.insert(prompts[0], fake_state(40))


def test_store_replaces_a_prefix_by_its_extension():
    """A conversation's next turn extends the stored prompt: its entry replaces the shorter one (no rows kept
    twice) and still serves the shorter prefix; a prompt that only shares a shorter prefix keeps its own."""
    store = PrefixCache(block_size=16, window=16, budget_bytes=10_000)
    tokens = list(range(96))
    store.insert(tokens[:32], fake_state(32))
    store.insert(tokens[:64], fake_state(64))
    assert len(store.entries) == 1 and store.nbytes == 64 * 4
    assert store.lookup(tokens[:40]).length == 32 and store.lookup(tokens).length == 64
    other = tokens[:32] + [7] * 32  # shares 32 tokens, then goes elsewhere
    store.insert(other, fake_state(64))
    assert len(store.entries) == 2 and store.lookup(other).length == 64 and store.lookup(tokens).length == 64


@torch.no_grad()
def test_generate_reuses_the_previous_turn_through_the_prefix_cache():
    """Two turns of a conversation through generate(): the second prompt (the first, its answer and new
    tokens) hits the first turn's 48-token prefix; its first token is what restoring that state by hand and
    replaying from 48 - 16 gives. With bounded replay off the store is not used and generate() is exact."""
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(preset_config("tiny")).eval()
    store = model.enable_prefix_cache(budget_bytes=1 << 24)
    first = prompt(50)
    turn1 = model.generate(first, max_new_tokens=8, do_sample=False)
    assert store.stats.inserts == 1 and store.stats.hits == 0
    second = torch.cat([turn1, prompt(20, seed=1)], 1)  # 78 tokens
    turn2 = model.generate(second, max_new_tokens=4, do_sample=False)
    assert (store.stats.hits, store.stats.hit_tokens) == (1, 48)

    window = model.model.text_config.sliding_window
    cache = model.new_cache(1, 96)
    history = prefill(model, second[:, :48 - window]).engram_history[0]
    restore(cache, 0, store.lookup(second[0].tolist()[:48]), history)
    hidden = model.model.run(second[:, 48 - window:], torch.ones(1, 78 - 48 + window, dtype=torch.long), cache, 78,
                             replay_from=torch.tensor([48]))
    assert turn2[0, 78].item() == model.logits(hidden[:, -1:]).argmax(-1).item()

    model.model.text_config.swa_bounded_replay = False
    hits = store.stats.hits
    exact = DeepseekV41ForCausalLM(preset_config("tiny", swa_bounded_replay=False)).eval()
    exact.load_state_dict(model.state_dict())
    assert torch.equal(model.generate(second, max_new_tokens=4, do_sample=False),
                       exact.generate(second, max_new_tokens=4, do_sample=False))
    assert store.stats.hits == hits


@torch.no_grad()
def test_compiled_generate_uses_the_prefix_cache_like_eager():
    """The same two turns through compile() (eager backend: the graph plumbing, chunked prefill with
    replay_from) and eagerly, each with its own prefix cache: the same tokens and the same hits."""
    import dsflash_compile

    def two_turns(model):
        store = model.enable_prefix_cache(budget_bytes=1 << 24)
        turn1 = model.generate(prompt(50), max_new_tokens=8, do_sample=False)
        turn2 = model.generate(torch.cat([turn1, prompt(20, seed=1)], 1), max_new_tokens=4, do_sample=False)
        return turn2, store.stats.hits

    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(preset_config("tiny")).eval()
    want = two_turns(model)
    torch._dynamo.reset()
    try:
        dsflash_compile.compile(model, max_batch=1, max_length=96, batch_buckets=(1,), prefill_buckets=(16, 32),
                                backend="eager", passes=False)
        got = two_turns(model)
    finally:
        torch._dynamo.reset()
    assert got[1] == want[1] == 1
    assert torch.equal(got[0], want[0])


@torch.no_grad()
@pytest.mark.parametrize("quantize", [False, True])
def test_hit_equals_a_slow_token_by_token_replay(quantize):
    """The batched replay of [H - W, L) after a restore against the same tokens fed one at a time (one-token
    contexts: the ring, the compressor's open group and the indexer all advance token by token), each with
    replay_from=H. The indexer keeps every visible row here (top-k 64, 16 candidate blocks), but the router's
    top-2 of 8 experts can still flip at a near tie between one-token and batched GEMMs, which moves that
    token's output a lot (the plain prompt, without any restore, shows the same); so: the typical token
    within ~2 bf16 ulps, and only a few tokens beyond 1/16 of the scale. Skipping a floor breaks most."""
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(preset_config("tiny", quantize_dequantize=quantize, index_topk=64,
                                                 candidate_topk_blocks=16)).eval()
    window = model.model.text_config.sliding_window
    ids = prompt()
    state = snapshot(prefill(model, ids[:, :H]), 0, H)
    history = prefill(model, ids[:, :H - window]).engram_history[0]
    caches = [model.new_cache(1, 64) for _ in range(2)]
    for cache in caches:
        restore(cache, 0, state, history)
    start = torch.tensor([H])
    fast = model.model.run(ids[:, H - window:], torch.ones(1, L - H + window, dtype=torch.long), caches[0], L,
                           replay_from=start)
    slow = torch.cat([model.model.run(ids[:, t:t + 1], torch.ones(1, 1, dtype=torch.long), caches[1], L,
                                      replay_from=start) for t in range(H - window, L)], dim=1)
    err = (fast.float() - slow.float()).abs().amax(-1)[0] / slow.float().abs().max()
    print(f"prefix hit fast vs slow (quantize={quantize}): median {err.median():.2e}, max {err.max():.2e}, "
          f"tokens beyond 1/16: {int((err > 2 ** -4).sum())} of {err.numel()}")
    assert err.median() <= 2 ** -6
    assert (err > 2 ** -4).float().mean() <= 0.1
    assert torch.equal(caches[0].lengths, caches[1].lengths)


@torch.no_grad()
def test_batch_with_one_hit_and_one_miss_matches_each_row_alone():
    """A ragged batch of two prompts (left-padded) where only the first extends a cached prefix: each row's
    first token is what the same prompt gives alone with the same store contents (hit or miss)."""
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(preset_config("tiny", quantize_dequantize=False)).eval()
    base = prompt(50)
    hit_prompt, miss_prompt = torch.cat([base, prompt(14, seed=1)], 1), prompt(40, seed=2)

    def first_tokens(prompts):
        model.enable_prefix_cache(budget_bytes=1 << 24)
        model.generate(base, max_new_tokens=1, do_sample=False)  # stores base's 48-token prefix
        ids, mask = left_pad([p[0] for p in prompts])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        return out[:, -1].tolist(), model.prefix_cache.stats.hits

    batch, hits = first_tokens([hit_prompt, miss_prompt])
    assert hits == 1
    assert batch == [first_tokens([hit_prompt])[0][0], first_tokens([miss_prompt])[0][0]]
