"""The model as a library: batches, cache, save/load, errors, generate(), the CLI (tiny preset, CPU)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.cache import CacheCapacityError
from dsflash_compile.checkpoint import CheckpointError
from golden import TINY_A, load_model, requires_golden


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return DeepseekV41ForCausalLM(preset_config("tiny")).eval()


def test_the_package_runs_without_triton():
    """Triton is optional on CPU machines (the `cuda` extra): with it unimportable the package imports, its
    compile options validate and the tiny model runs on the ops' references (a subprocess: this one imported
    triton)."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from dsflash_compile import DeepseekV41ForCausalLM, preset_config\n"
            "from dsflash_compile.compiled import CompileOptions\n"
            "CompileOptions(mhc_overlap=True)\n"
            "model = DeepseekV41ForCausalLM(preset_config('tiny')).eval()\n"
            "print(tuple(model(torch.tensor([[5, 6, 7]])).logits.shape))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("(1, 3, 512)"), proc.stdout + proc.stderr[-3000:]


def prompts(lengths, vocab=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]


def left_pad(seqs, pad_id=2):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], mask[i, width - len(s):] = s, 1
    return ids, mask


@pytest.mark.parametrize("quantize", [True, False])
def test_ragged_batch_matches_each_prompt_alone(quantize):
    """Left-padded prompts of lengths 37/80/5, prefilled, then 6 decode steps, against each prompt alone
    (chunked prefill is covered against the golden fixture). A batch turns the [1, .] decode GEMMs into [3, .]
    ones and the 5-token prompt's [5, .] prefill GEMMs into [80, .] ones, which MKL may round differently (on
    earlier machines prefill was bit-equal; on the AMX machine of 12-04 the padded prompt's prefill logits
    moved by up to 0.018): with the release's FP8/FP4 steps an ulp can flip a quantization step (measured max
    0.13 on logits of scale ~1), without them up to 0.025. The top token must agree wherever the one alone leads by
    more than twice the largest deviation (there no rounding can reorder it)."""
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(preset_config("tiny", quantize_dequantize=quantize)).eval()
    seqs = prompts([37, 80, 5])
    ids, mask = left_pad(seqs)
    steps = torch.randint(3, 512, (3, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.new_cache(3, 90)
        batch = model(ids, attention_mask=mask, cache=cache).logits
        full_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        decode = torch.stack([model(steps[:, i:i + 1], attention_mask=full_mask, cache=cache).logits[:, 0]
                              for i in range(6)], 1)
        for i, s in enumerate(seqs):
            alone_cache = model.new_cache(1, 90)
            alone = model(s[None], cache=alone_cache).logits[0]
            alone_dec = torch.stack([model(steps[i:i + 1, j:j + 1], cache=alone_cache).logits[0, 0]
                                     for j in range(6)])
            bound = 0.25 if quantize else 5e-2
            for ours, theirs in ((batch[i, ids.shape[1] - len(s):], alone), (decode[i], alone_dec)):
                deviation = (ours - theirs).abs().max()
                assert deviation <= bound, (i, float(deviation))
                top2 = theirs.topk(2, dim=-1).values
                clear = top2[..., 0] - top2[..., 1] > 2 * deviation
                assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear]), i
        assert cache.lengths[:3].tolist() == [37 + 6, 80 + 6, 5 + 6]


def test_generate_batched_ragged_equals_single(tiny):
    """generate() on a left-padded batch gives each prompt's own greedy continuation."""
    seqs = prompts([20, 33], seed=3)
    ids, mask = left_pad(seqs)
    out = tiny.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    for i, s in enumerate(seqs):
        alone = tiny.generate(s[None], max_new_tokens=6, do_sample=False)
        assert out[i, ids.shape[1]:].tolist() == alone[0, len(s):].tolist()


def test_generate_sampling_and_cache_reuse(tiny):
    """Sampling runs through generate(); a user cache is reused across calls after reset()."""
    ids = prompts([12])[0][None]
    torch.manual_seed(0)
    sampled = tiny.generate(ids, max_new_tokens=4, do_sample=True, top_k=20, temperature=0.8)
    assert sampled.shape == (1, 16)
    cache = tiny.new_cache(1, 32)
    a = tiny.generate(ids, max_new_tokens=4, do_sample=False, **{_cache_kw(): cache})
    cache.reset()
    b = tiny.generate(ids, max_new_tokens=4, do_sample=False, **{_cache_kw(): cache})
    assert torch.equal(a, b)


def _cache_kw():
    from dsflash_compile.modeling_deepseek_v41 import CACHE_KWARG

    return CACHE_KWARG


def test_left_padded_chunk_after_cached_tokens(tiny):
    """A later chunk may be left-padded (the compiled runner pads chunks to length buckets): the padding
    columns are inert, Engram's n-gram look-backs skip them and reach the cached history."""
    ids = prompts([40])[0][None].repeat(2, 1)
    with torch.no_grad():
        want = tiny(ids).logits[:, -1]
        cache = tiny.new_cache(2, 64)
        tiny(ids[:, :32], cache=cache)
        chunk = torch.nn.functional.pad(ids[:, 32:], (8, 0), value=2)
        mask = torch.nn.functional.pad(torch.ones(2, 8, dtype=torch.long), (8, 0))
        got = tiny(chunk, mask, cache=cache).logits[:, -1]
    assert torch.equal(got, want)


def test_restored_cache_state_gives_the_same_steps(tiny):
    """save_state / restore_state: decode steps after a restore give the bits of the steps after the save, and
    the host-side counters come back too."""
    ids = prompts([20])[0][None]
    with torch.no_grad():
        cache = tiny.new_cache(1, 32)
        tiny(ids, cache=cache)
        saved, seen = cache.save_state(), cache.seen_columns
        first = [tiny(ids[:, i:i + 1], cache=cache).logits for i in range(3)]
        cache.restore_state(saved)
        assert cache.seen_columns == seen
        again = [tiny(ids[:, i:i + 1], cache=cache).logits for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_no_cache_forward_equals_cached(tiny):
    """A forward without a cache (temporary one) equals the cached prefill; use_cache=False returns none."""
    ids = prompts([30])[0][None]
    with torch.no_grad():
        out = tiny(ids, use_cache=False)
        cached = tiny(ids, cache=tiny.new_cache(1, 30)).logits
    assert torch.equal(out.logits, cached)
    assert out.get(_cache_kw()) is None


def test_save_load_roundtrip_single_and_sharded(tiny, tmp_path):
    """save_pretrained then from_pretrained (AutoModel too) gives identical logits, one file or shards."""
    from transformers import AutoModelForCausalLM

    ids = prompts([40])[0][None]
    with torch.no_grad():
        ref = tiny(ids).logits
    tiny.save_pretrained(tmp_path / "one")
    tiny.save_pretrained(tmp_path / "shards", max_shard_size="2MB")
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    for folder in ("one", "shards"):
        for loader in (DeepseekV41ForCausalLM, AutoModelForCausalLM):
            model = loader.from_pretrained(tmp_path / folder)
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref), (folder, loader)


@requires_golden
def test_save_writes_the_release_layout(tmp_path):
    """The fixture saved again has the release's names, dtypes and shapes, and values identical to the
    fixture's (scales are re-derived, so a group at the bottom of its binade may store codes x2 / scale / 2)."""
    from dsflash_compile.checkpoint import CheckpointReader

    load_model().save_pretrained(tmp_path)
    ours, ref = load_file(tmp_path / "model.safetensors"), load_file(TINY_A / "model.safetensors")
    assert sorted(ours) == sorted(ref)
    for name in ref:
        assert ours[name].dtype == ref[name].dtype and ours[name].shape == ref[name].shape, name
    ref_values = dict(CheckpointReader(TINY_A).items())
    for name, value in CheckpointReader(tmp_path).items():
        assert torch.equal(value, ref_values[name]), name


@pytest.fixture
def fixture_copy(tmp_path):
    if not (TINY_A / "model.safetensors").exists():
        pytest.skip("golden fixture not found")
    folder = tmp_path / "ckpt"
    shutil.copytree(TINY_A, folder)
    return folder


def _edit_checkpoint(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_tensor_is_named(fixture_copy):
    _edit_checkpoint(fixture_copy, lambda t: t.pop("layers.3.attn.q_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensors: layers\.3\.attn\.q_norm\.weight"):
        DeepseekV41ForCausalLM.from_pretrained(fixture_copy)


def test_wrong_shape_tensor_is_named(fixture_copy):
    _edit_checkpoint(fixture_copy, lambda t: t.__setitem__("layers.0.ffn_norm.weight", torch.ones(255).bfloat16()))
    with pytest.raises(CheckpointError,
                       match=r"layers\.0\.ffn_norm\.weight: wrong shape: expected \[256\], found \[255\]"):
        DeepseekV41ForCausalLM.from_pretrained(fixture_copy)


def test_wrong_dtype_tensor_is_named(fixture_copy):
    _edit_checkpoint(fixture_copy, lambda t: t.__setitem__("norm.weight", t["norm.weight"].half()))
    with pytest.raises(CheckpointError, match=r"norm\.weight: wrong dtype"):
        DeepseekV41ForCausalLM.from_pretrained(fixture_copy)


def test_missing_engram_token_map_is_named(fixture_copy):
    (fixture_copy / "engram_token_map.safetensors").unlink()
    (fixture_copy / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="engram_token_map.safetensors.*tokenizer.json|tokenizer.json.*engram"):
        DeepseekV41ForCausalLM.from_pretrained(fixture_copy)


def test_mtp_and_vision_tensors_are_skipped(fixture_copy, caplog):
    _edit_checkpoint(fixture_copy, lambda t: t.update({"mtp.0.attn_norm.weight": torch.ones(256).bfloat16(),
                                                       "vision.patch.weight": torch.ones(4, 4).bfloat16()}))
    with caplog.at_level("INFO"):
        DeepseekV41ForCausalLM.from_pretrained(fixture_copy)
    assert "skipped 2 tensors" in caplog.text


def test_prompt_longer_than_cache(tiny):
    cache = tiny.new_cache(1, 16)
    with pytest.raises(CacheCapacityError, match="exceeds the cache's max_length=16"):
        tiny(prompts([17])[0][None], cache=cache)
    tiny(prompts([10])[0][None], cache=cache)
    with pytest.raises(CacheCapacityError, match=r"10 cached \+ 7 new"):
        tiny(prompts([7])[0][None], cache=cache)


def test_batch_larger_than_cache(tiny):
    with pytest.raises(CacheCapacityError, match="batch of 3 rows exceeds the cache's max_batch=2"):
        tiny(torch.ones(3, 4, dtype=torch.long), cache=tiny.new_cache(2, 16))


def test_right_padding_is_rejected(tiny):
    ids, mask = torch.ones(1, 6, dtype=torch.long), torch.tensor([[1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="padding must be on the left"):
        tiny(ids, attention_mask=mask)


def test_inputs_embeds_rejected(tiny):
    with pytest.raises(ValueError, match="inputs_embeds"):
        tiny(torch.ones(1, 2, dtype=torch.long), inputs_embeds=torch.zeros(1, 2, 256))


def test_unknown_from_pretrained_argument(tmp_path, tiny):
    tiny.save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="unexpected argument 'not_a_field'"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path, not_a_field=1)
    with pytest.raises(ValueError, match="dtype=torch.float16"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)


def test_cli_generate_tiny(capsys):
    """`dsflash generate --preset tiny` runs on CPU and prints ids and tokens/s."""
    from dsflash_compile.cli import main

    assert main(["generate", "--preset", "tiny", "--prompt-ids", "0,5,9", "12", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "generated ids:" in out and len(out.split("generated ids:")[1].splitlines()[0].split()) == 4
    assert "tokens/s" in out


def test_cli_bounded_replay_switch(capsys):
    """A 40-token prompt (longer than tiny's 16-token window) with and without bounded replay: both run and
    say which they used."""
    from dsflash_compile.cli import main

    for flag, state in (([], "on"), (["--no-swa-bounded-replay"], "off")):
        assert main(["generate", "--preset", "tiny", "--prompt-len", "40", "--max-new-tokens", "2", *flag]) == 0
        assert f"bounded replay {state}" in capsys.readouterr().out


@requires_golden
def test_cli_generate_checkpoint(capsys):
    from dsflash_compile.cli import main

    assert main(["generate", "--model", str(TINY_A), "--prompt-ids", "0 17 42", "--max-new-tokens", "2"]) == 0
    assert "generated ids:" in capsys.readouterr().out


def test_growing_cache_bytes_per_token():
    """The release's growing cache with the default CUDA formats is 890 B/token (MODEL.md section 7):
    3 ratio-2 sources x 0.5 x (288 + 68) + 1 ratio-1 source x (288 + 68); bf16 storage for comparison."""
    from dsflash_compile.cache import DeepseekV41Cache, growing_bytes_per_token

    release = preset_config("release").text_config
    assert growing_bytes_per_token(release) == 890
    assert growing_bytes_per_token(release, "bf16", "bf16") == 3 * 0.5 * (1024 + 256) + (1024 + 256)
    tiny = preset_config("tiny").text_config
    cache = DeepseekV41Cache(tiny, 1, 32, window_format="fp8", compressed_format="nvfp4", index_format="mxfp4")
    assert cache.bytes_per_token == 0.5 * (36 + 34) + (36 + 34)  # dims 64 / 64: E2M1 halves + scales
    assert cache.window[0].shape == (1, 16, 64 + 2)  # 64 E4M3 codes + 2 UE8M0 scales per slot
    with pytest.raises(ValueError, match="compressed_format='fp8'"):
        DeepseekV41Cache(tiny, 1, 32, compressed_format="fp8")


def test_window_floor_hides_positions_below_it(tiny):
    """The bounded-replay clamp: with window_floor f, no query's window lists a position below f, and a
    query at position p >= f sees exactly max(f, p - W + 1) .. p."""
    from dsflash_compile.context import build_context

    cache = tiny.new_cache(2, 64)
    with torch.no_grad():
        tiny(prompts([40])[0][None].repeat(2, 1), cache=cache)  # 40 cached positions per row
    ctx = build_context(cache, torch.ones(2, 8, dtype=torch.long), 48, window_floor=torch.tensor([0, 35]))
    window = cache.window_size
    for b, floor in enumerate((0, 35)):
        for t in range(8):
            p = 40 + t
            listed = ctx.window_idx[b, t]
            assert int((listed >= 0).sum()) == p - max(floor, p - window + 1) + 1


def test_setup_makes_the_visible_counts_once(tiny):
    """begin() makes each index source ratio's visible counts ((p + 1) // ratio, 0 for padding) once a forward; the
    index sources read that tensor; a query side on the last columns and the trimmed layers' tail context read its
    last columns."""
    from dsflash_compile.context import tail_context

    cache = tiny.new_cache(2, 64)
    ids, mask = left_pad(prompts([9, 12]))  # row 0: 3 columns of padding
    with torch.no_grad():
        ctx = tiny.model.begin(ids, mask, cache, 16)[0]
    ratios = {role.ratio for role in tiny.config.text_config.layer_roles if role.is_index_source}
    assert set(ctx.visible_rows) == ratios == {1, 2}
    for ratio in ratios:
        want = torch.where(ctx.positions >= 0, (ctx.positions + 1) // ratio, 0)
        assert torch.equal(ctx.visible_rows[ratio], want) and ctx.visible(ratio) is ctx.visible_rows[ratio]
        assert torch.equal(ctx.last_columns(4).visible(ratio), want[:, -4:])
        assert torch.equal(tail_context(ctx, mask, 4).visible(ratio), want[:, -4:])
