"""SWA bounded replay, decoder side (tiny preset, CPU): in a prompt chunk longer than the window, the
layers after the last KV source run on each row's last `sliding_window` tokens only, their window attention
seeing nothing below the first of them."""

import pytest
import torch

import dsflash_compile
from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.context import build_context
from dsflash_compile.mhc import PendingPost, expanded, hc_pre
from dsflash_compile.rope import rotation
from test_model import left_pad, prompts


def tiny_model(**overrides):
    torch.manual_seed(0)
    return DeepseekV41ForCausalLM(preset_config("tiny", **overrides)).eval()


def ragged(lengths):
    """Left-padded random prompts of these lengths: (ids, mask)."""
    return left_pad(prompts(lengths))


@torch.no_grad()
def test_replay_off_is_full_recomputation():
    """With the switch off, asking for the last output only changes nothing: every layer sees every token
    (with it on, the same call is trimmed)."""
    for replay in (False, True):
        model = tiny_model(swa_bounded_replay=replay)
        ids, mask = ragged([50, 23])
        full = model.model(ids, mask, model.new_cache(2, 64))
        last = model.model(ids, mask, model.new_cache(2, 64), keep=1)
        assert torch.equal(last[:, -1:], full[:, -1:]) != replay


@torch.no_grad()
def test_trimmed_layers_receive_exactly_the_last_window_of_each_row():
    """Layers up to the last KV source (5 in tiny) get all 50 columns; layers 6-8 get the last 16 (the
    window), at the right positions, with no window key below the first of them; a 10-token prompt in the
    same batch keeps its 10 real tokens there. Without keep (all logits asked for) nothing is trimmed."""
    model = tiny_model()
    text = model.model.text_config
    window, cut = text.sliding_window, text.last_kv_source_layer
    ids, mask = ragged([50, 10])
    seen = {}

    def record(block, args):
        _, pre_mix, ctx = args[:3]  # (the streams may be a PendingPost: the pre-mix has their columns)
        seen[block.role.layer] = (pre_mix.shape[1], ctx.positions.clone(), ctx.window_idx.clone())

    hooks = [block.register_forward_pre_hook(record) for block in model.model.layers]
    logits = model(ids, attention_mask=mask, cache=model.new_cache(2, 64), logits_to_keep=1).logits
    assert logits.shape == (2, 1, text.vocab_size)
    for layer, (columns, positions, window_idx) in seen.items():
        if layer <= cut:
            assert columns == 50
            continue
        assert columns == window
        assert positions[0].tolist() == list(range(50 - window, 50))
        assert positions[1].tolist() == [-1] * (window - 10) + list(range(10))
        # row 0: the query at position 34 + i sees tail keys 0..i only (chunk rows W + i), none from the ring
        valid = window_idx[0] >= 0
        assert valid.sum(-1).tolist() == list(range(1, window + 1))
        assert bool((window_idx[0][valid] >= window).all())
    seen.clear()
    model(ids, attention_mask=mask, cache=model.new_cache(2, 64))
    assert all(columns == 50 for columns, _, _ in seen.values())
    for hook in hooks:
        hook.remove()


@torch.no_grad()
def test_last_kv_source_writes_every_column_but_runs_its_queries_and_ffn_on_the_last_window():
    """At the last KV source (5 in tiny) bounded replay keeps the key side whole: its ring, compressed rows and
    index keys, and every earlier layer's cache, are exactly a full prefill's, while its attention queries
    and FFN run on the last window of columns; a chunk before the last (tail 0) writes the same and runs
    neither."""
    model = tiny_model()
    inner, text = model.model, model.model.text_config
    window, cut = text.sliding_window, text.last_kv_source_layer
    ids, mask = ragged([50, 10])
    block = inner.layers[cut]
    columns = {}

    def record(name):
        return lambda module, args: columns.setdefault(name, []).append(args[0].shape[1])

    hooks = [block.ffn.register_forward_pre_hook(record("ffn")), block.attn.q_norm.register_forward_pre_hook(
        record("queries"))]
    caches = {kind: model.new_cache(2, 64) for kind in ("full", "trimmed", "first chunk")}
    inner(ids, mask, caches["full"])
    inner(ids, mask, caches["trimmed"], keep=1)
    inner.run(ids, mask, caches["first chunk"], 50, tail=0)
    for hook in hooks:
        hook.remove()
    assert columns == {"ffn": [50, window], "queries": [50, window]}
    full = caches["full"]
    for kind in ("trimmed", "first chunk"):
        for role in text.layer_roles[:cut + 1]:
            want, got = full.layer(role), caches[kind].layer(role)
            for name in ("window", "compressed", "index_keys", "pending_kv", "pending_score"):
                if getattr(want, name) is not None:
                    assert torch.equal(getattr(got, name), getattr(want, name)), (kind, role.layer, name)


@torch.no_grad()
def slow_bounded_replay(model, ids):
    """An independent implementation of the approximation for one prompt [1, S]: the layers up to the last
    KV source on the whole prompt, then each of the last W tokens alone (decode-style one-token contexts,
    the window ring filled token by token, positions below the first tail token not visible) through the
    trimmed layers. Returns their final-norm hidden states [1, W, D]."""
    inner, text = model.model, model.model.text_config
    window, cut, seq = text.sliding_window, text.last_kv_source_layer, ids.shape[1]
    cache = model.new_cache(1, seq)
    ctx, streams, pre_mix, hash_ids = inner.begin(ids, torch.ones_like(ids), cache, seq)
    for block in inner.layers[:cut + 1]:
        if block.engram is not None:
            streams = block.engram(streams, hash_ids[block.role.layer])
        streams, pre_mix, topk = block(streams, pre_mix, ctx, cache.layer(block.role),
                                       ctx.topk.get(block.role.topk_layer))
        if block.role.is_index_source:
            ctx.topk[block.role.layer] = topk
    streams = expanded(streams)
    floor = torch.tensor([seq - window])
    outs = []
    for t in range(seq - window, seq):
        one = build_context(cache, torch.ones(1, 1, dtype=torch.long), seq, window_floor=floor,
                            lengths=torch.tensor([t]))
        one.inv_freq = ctx.inv_freq
        one.rotations = {kind: rotation(torch.tensor([[t]]), f) for kind, f in ctx.inv_freq.items()}
        one.topk = {layer: topk[:, t:t + 1] for layer, topk in ctx.topk.items()}
        one.candidates = ctx.candidates[:, t:t + 1]
        s, p = streams[:, t:t + 1], pre_mix[:, t:t + 1]
        for block in inner.layers[cut + 1:]:
            s, p, topk = block(s, p, one, cache.layer(block.role), one.topk.get(block.role.topk_layer))
            if block.role.is_index_source:
                one.topk[block.role.layer] = topk
        outs.append(inner.norm(hc_pre(expanded(s), p)))
    return torch.cat(outs, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("quantize", [False, True])
def test_replay_equals_a_slow_token_by_token_implementation(quantize):
    """The batched trimmed layers (tail context: sliced rotations, top-k and candidates, window lists with a
    floor, this chunk's keys) against token-by-token processing through the ring. One-token GEMMs round
    differently from batched ones: a bf16 ulp or two of the output without the release's quantization steps;
    with them an ulp can move an FP8 step, so the bound is looser there."""
    model = tiny_model(quantize_dequantize=quantize)
    window = model.model.text_config.sliding_window
    ids, _ = ragged([45])
    fast = model.model(ids, torch.ones_like(ids), model.new_cache(1, 45), keep=1)
    slow = slow_bounded_replay(model, ids)
    assert fast.shape == slow.shape == (1, window, model.model.text_config.hidden_size)
    err = (fast.float() - slow.float()).abs().max().item() / slow.float().abs().max().item()
    print(f"replay fast vs slow (quantize={quantize}): max abs error / max abs value {err:.2e}")
    assert err <= (2 ** -3 if quantize else 2 ** -6)  # with quantization: a moved FP8 step; without: ~2 bf16 ulps


@torch.no_grad()
def test_replay_changes_the_prompt_logits_only_by_the_approximation():
    """Replay on vs off on one 60-token prompt: the same shapes, close but (by design) not equal last
    logits, and identical logits when the prompt fits in the window (nothing to trim)."""
    on, off = tiny_model(), tiny_model(swa_bounded_replay=False)
    ids, mask = ragged([60])
    got = on(ids, attention_mask=mask, cache=on.new_cache(1, 64), logits_to_keep=1).logits
    want = off(ids, attention_mask=mask, cache=off.new_cache(1, 64), logits_to_keep=1).logits
    assert not torch.equal(got, want)
    short, short_mask = ragged([16])
    assert torch.equal(on(short, attention_mask=short_mask, cache=on.new_cache(1, 64), logits_to_keep=1).logits,
                       off(short, attention_mask=short_mask, cache=off.new_cache(1, 64), logits_to_keep=1).logits)


def test_compile_needs_a_prefill_bucket_as_long_as_the_window():
    with pytest.raises(ValueError, match="largest prefill bucket"):
        dsflash_compile.compile(tiny_model(), max_length=64, prefill_buckets=(4, 8), backend="eager")
    dsflash_compile.compile(tiny_model(), max_length=64, prefill_buckets=(4, 8), backend="eager",
                            swa_bounded_replay=False)


@torch.no_grad()
def test_trimmed_graph_inputs_are_listed_before_the_layers_publish_top_k():
    """TrimmedGraphs (CUDA) pairs a captured graph's static inputs with each later call's inputs. The tiny
    model's layer 7 is an index source after the cut: running the trimmed layers adds its top-k to the
    context they get, so the static copy and its input list must be taken before anything runs (on the
    H200 a list taken afterwards paired a top-k with the candidates). The listing itself runs on the CPU."""
    from dsflash_compile import trimmed_graphs
    from dsflash_compile.context import tail_context

    model = tiny_model(swa_bounded_replay=True)
    cut = model.model.text_config.last_kv_source_layer + 1
    cache = model.new_cache(2, 64)

    def trimmed_arguments(seed):
        ids, mask = left_pad(prompts([40, 40], seed=seed))
        ctx, streams, pre_mix, hash_ids = model.model.begin(ids, mask, cache, 64)
        layers = model.model.layers
        streams, pre_mix = model.model.run_layers(layers[:cut - 1], ctx, cache, streams, pre_mix, hash_ids)
        streams, pre_mix = model.model.run_layers(layers[cut - 1:cut], ctx, cache, streams, pre_mix, hash_ids, 16)
        assert isinstance(streams, PendingPost)  # as DeepseekV41Model.run hands them over: listed field by field
        return tail_context(ctx, mask, 16), streams, pre_mix, {}

    first = trimmed_arguments(1)
    static = trimmed_graphs._static_copy(*first)
    listed = trimmed_graphs._inputs(*static)
    model.model.run_trimmed(first[0], cache, *first[1:])  # the first call's direct run
    assert len(first[0].topk) > len(static[0].topk)  # the run published a top-k into the live context
    later = trimmed_arguments(2)
    assert trimmed_graphs._signature(*later) == trimmed_graphs._signature(*static)
    assert [(t.shape, t.dtype) for t in listed] == [(t.shape, t.dtype) for t in trimmed_graphs._inputs(*later)]


def test_trimmed_graph_static_copy_keeps_inference_and_normal_tensors_apart():
    """The static copy is made under the caller's inference mode; a model buffer in the context (the RoPE
    frequencies) must stay a normal tensor, or the compiled blocks' dispatch-key guards recompile them all
    (on the H200: inside the capture)."""
    from dsflash_compile import trimmed_graphs
    from dsflash_compile.context import tail_context

    model = tiny_model(swa_bounded_replay=True)
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        ids, mask = left_pad(prompts([40], seed=3))
        ctx, streams, pre_mix, hash_ids = model.model.begin(ids, mask, cache, 64)
        live = tail_context(ctx, mask, 16), streams[:, -16:].contiguous(), pre_mix[:, -16:].contiguous(), {}
        static = trimmed_graphs._static_copy(*live)
    kinds = [t.is_inference() for t in trimmed_graphs._inputs(*live)]
    assert [t.is_inference() for t in trimmed_graphs._inputs(*static)] == kinds
    assert not all(kinds) and any(kinds)  # the frequencies are buffers, the rest made under inference mode
