"""Engram token-id side (MODEL.md 3.1-3.3) against the golden fixture `tiny-a`."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from dsflash_compile.engram_hash import (
    build_token_map,
    derive_hash_params,
    engram_hash_ids,
    initial_history,
    load_token_map,
    update_history,
)

from golden import SHARED  # noqa: E402
from golden import TINY_A as FIXTURE  # noqa: E402
RELEASE_CONFIG = SHARED / "configs" / "deepseek-v4.1-flash.config.json"

needs_fixture = pytest.mark.skipif(
    not FIXTURE.is_dir(), reason=f"golden fixture not found at {FIXTURE} (expected ../shared)"
)
needs_release_config = pytest.mark.skipif(
    not RELEASE_CONFIG.is_file(), reason=f"release config not found at {RELEASE_CONFIG}"
)


def _text_config(path):
    cfg = json.loads(Path(path).read_text())
    return cfg.get("text_config", cfg)


def _params_from_config(tc, pad_compressed_id):
    return derive_hash_params(
        tc["engram_layer_ids"],
        tc["engram_max_ngram_size"],
        tc["engram_n_heads"],
        tc["engram_vocab_size"],
        tc["engram_compressed_vocab_size"],
        pad_compressed_id,
    )


@pytest.fixture(scope="module")
def fixture_data():
    from safetensors.torch import load_file

    token_map = load_file(str(FIXTURE / "engram_token_map.safetensors"))["token_map"]
    tc = _text_config(FIXTURE / "config.json")
    params = _params_from_config(tc, int(token_map[tc["engram_pad_token_id"]]))
    inputs = load_file(str(FIXTURE / "inputs.safetensors"))
    debug = load_file(str(FIXTURE / "debug.safetensors"))
    return dict(token_map=token_map, tc=tc, params=params, inputs=inputs, debug=debug)


def _all_layers(cids, history, params):
    # -> [B, T, nE, cols], the layout of debug.safetensors' engram_hash_ids
    return torch.stack(
        [engram_hash_ids(cids, history, params, i) for i in range(len(params.layer_ids))], dim=2
    )


@needs_fixture
def test_token_map_matches_fixture(fixture_data):
    built = build_token_map(FIXTURE / "tokenizer.json")
    expected = fixture_data["token_map"]
    assert built.dtype == torch.int64
    assert built.shape == expected.shape
    assert torch.equal(built, expected)
    assert int(built.unique().numel()) == 197 == fixture_data["tc"]["engram_compressed_vocab_size"]


@needs_fixture
def test_load_token_map_prefers_shipped_then_builds(fixture_data, tmp_path):
    assert torch.equal(load_token_map(FIXTURE), fixture_data["token_map"])
    shutil.copy(FIXTURE / "tokenizer.json", tmp_path / "tokenizer.json")
    assert torch.equal(load_token_map(tmp_path), fixture_data["token_map"])


def test_missing_tokenizer_error(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_token_map(tmp_path)
    msg = str(err.value)
    assert "engram_token_map.safetensors" in msg and "tokenizer.json" in msg


@needs_fixture
def test_hash_params_match_fixture(fixture_data):
    params = fixture_data["params"]
    ref = json.loads((FIXTURE / "engram_hash_params.json").read_text())
    assert list(params.layer_ids) == ref["layer_ids"]
    assert params.pad_compressed_id == ref["pad_compressed_id"]
    assert [[list(g) for g in layer] for layer in params.primes] == ref["primes"]
    assert [list(o) for o in params.offsets] == ref["offsets"]
    assert [list(m) for m in params.multipliers] == ref["multipliers"]
    assert list(params.table_rows) == ref["table_rows"]
    assert list(params.table_rows) == fixture_data["tc"]["engram_num_embeddings"]


@needs_release_config
def test_hash_params_release_table_rows():
    tc = _text_config(RELEASE_CONFIG)
    params = _params_from_config(tc, pad_compressed_id=0)  # pad id does not enter the rows
    assert params.table_rows == (384_006_168, 384_016_682)
    assert list(params.table_rows) == tc["engram_num_embeddings"]
    flat = [p for layer in params.primes for g in layer for p in g]
    assert len(set(flat)) == len(flat) == 2 * 3 * 8
    assert all(m % 2 == 1 for layer in params.multipliers for m in layer)


@needs_fixture
def test_prefill_and_decode_hash_ids_match_fixture(fixture_data):
    tm, params = fixture_data["token_map"], fixture_data["params"]
    prompt = fixture_data["inputs"]["prompt_ids"]
    decode_in = fixture_data["inputs"]["decode_input_ids"]
    dbg = fixture_data["debug"]

    hist = initial_history(prompt.shape[0], params)
    cids = tm[prompt]
    got = _all_layers(cids, hist, params)
    assert got.shape == dbg["prefill.engram_hash_ids"].shape
    assert torch.equal(got, dbg["prefill.engram_hash_ids"])

    hist = update_history(hist, cids)
    steps = []
    for i in range(decode_in.shape[1]):
        step = tm[decode_in[:, i : i + 1]]
        steps.append(_all_layers(step, hist, params))
        hist = update_history(hist, step)
    got_dec = torch.cat(steps, dim=1)
    assert got_dec.shape == dbg["decode.engram_hash_ids"].shape
    assert torch.equal(got_dec, dbg["decode.engram_hash_ids"])


@needs_fixture
@pytest.mark.parametrize("splits", [[1], [2], [3], [4], [50], [1, 2, 3], [7, 8, 40, 99], [99]])
def test_chunked_equals_one_shot(fixture_data, splits):
    tm, params = fixture_data["token_map"], fixture_data["params"]
    cids = tm[fixture_data["inputs"]["prompt_ids"]]
    cids = torch.cat([cids, cids.flip(1)], dim=0)  # batch 2 with different rows
    full = _all_layers(cids, initial_history(2, params), params)

    hist, parts, start = initial_history(2, params), [], 0
    for end in splits + [cids.shape[1]]:
        chunk = cids[:, start:end]
        parts.append(_all_layers(chunk, hist, params))
        hist = update_history(hist, chunk)
        start = end
    assert torch.equal(torch.cat(parts, dim=1), full)


def test_hash_ids_are_in_table_range():
    params = derive_hash_params([1, 14], 4, 8, 16_000_000, 99092, 2)
    g = torch.Generator().manual_seed(0)
    cids = torch.randint(0, 99092, (3, 64), generator=g)
    hist = initial_history(3, params)
    for i, rows in enumerate(params.table_rows):
        ids = engram_hash_ids(cids, hist, params, i)
        assert ids.shape == (3, 64, 24)
        assert int(ids.min()) >= 0 and int(ids.max()) < rows
        # column c lies in its own [offset, offset + prime) slice of the table
        lo = torch.tensor(params.offsets[i])
        hi = lo + torch.tensor(params.flat_primes(i))
        assert bool(((ids >= lo) & (ids < hi)).all())
