"""Checkpoint layout: reading (lazy, sharded, skipping), load_into errors, save_checkpoint round trips."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsflash_compile import formats as F
from dsflash_compile.checkpoint import (
    FP8_BLOCK,
    FP8_ROWS,
    MXFP4,
    CheckpointError,
    CheckpointReader,
    load_into,
    official_dtype,
    save_checkpoint,
    weight_format,
)

FIXTURE = Path(__file__).resolve().parents[1].parent / "shared" / "golden" / "tiny-a"
needs_fixture = pytest.mark.skipif(not (FIXTURE / "model.safetensors").exists(), reason=f"golden fixture not found at {FIXTURE}")


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_files_match_fixture(tensors):
    ref = load_file(FIXTURE / "model.safetensors")
    assert sorted(tensors) == sorted(ref)
    for name, t in ref.items():
        assert same_bytes(tensors[name], t), name


def tiny_tensors():
    """A few tensors of every kind, stored form (what save_file writes)."""
    g = torch.Generator().manual_seed(0)
    q, s = F.quant_fp8_block(torch.randn(40, 64, generator=g))
    e, es = F.quant_mxfp4(torch.randn(8, 64, generator=g))
    return {
        "embed.weight": torch.randn(16, 64, generator=g).bfloat16(),
        "layers.0.attn.wq_a.weight": q,
        "layers.0.attn.wq_a.scale": s,
        "layers.0.ffn.experts.0.w1.weight": e,
        "layers.0.ffn.experts.0.w1.scale": es,
        "layers.0.attn.attn_sink": torch.randn(4, generator=g),
        "layers.0.hc_attn_fn": torch.randn(6, 16, generator=g),
    }


def targets(stored):
    """What a model would hold for `stored`: meta tensors, quantized weights as bf16, others in official dtype."""
    out = {}
    for name, t in stored.items():
        fmt = weight_format(name)
        if name.endswith(".scale") and fmt:
            continue
        shape = (t.shape[0], 2 * t.shape[1]) if fmt == MXFP4 else t.shape
        out[name] = torch.empty(shape, dtype=torch.bfloat16 if fmt else official_dtype(name), device="meta")
    return out


# ------------------------------------------------------------------------------------------ format table


def test_format_table():
    assert weight_format("layers.3.attn.wkv.weight") == FP8_BLOCK
    assert weight_format("layers.3.attn.wkv.scale") == FP8_BLOCK
    assert weight_format("layers.3.attn.compressor.wkv.weight") is None
    assert weight_format("layers.3.attn.indexer.wq_b.weight") == FP8_BLOCK
    assert weight_format("layers.3.attn.indexer.wk.weight") is None
    assert weight_format("layers.3.ffn.shared_experts.w2.weight") == FP8_BLOCK
    assert weight_format("layers.3.ffn.experts.17.w3.weight") == MXFP4
    assert weight_format("layers.1.engram.embed.weight") == FP8_ROWS
    assert weight_format("layers.1.engram.wkv.weight") == FP8_BLOCK
    assert official_dtype("layers.0.hc_ffn_fn") == torch.float32
    assert official_dtype("layers.0.ffn.gate.bias_vl") == torch.float32
    assert official_dtype("layers.2.attn.compressor.wgate.weight") == torch.bfloat16
    with pytest.raises(CheckpointError, match="layers.0.attn.bogus"):
        official_dtype("layers.0.attn.bogus")


@needs_fixture
def test_official_dtype_matches_fixture_storage():
    with safe_open(FIXTURE / "model.safetensors", "pt") as f:
        for name in f.keys():
            assert official_dtype(name) == f.get_tensor(name).dtype, name


# ------------------------------------------------------------------------------------------ reading


@needs_fixture
def test_reader_dequantizes_fixture():
    ref = load_file(FIXTURE / "model.safetensors")
    n_scales = sum(k.endswith(".scale") for k in ref)
    reader = CheckpointReader(FIXTURE)
    tensors = dict(reader)
    assert len(reader) == len(tensors) == len(ref) - n_scales == 440
    assert not any(k.endswith(".scale") for k in tensors)
    w = tensors["layers.0.attn.wkv.weight"]
    assert w.dtype == torch.bfloat16 and w.shape == (64, 256)
    assert torch.equal(w, F.dequant_fp8_block(ref["layers.0.attn.wkv.weight"], ref["layers.0.attn.wkv.scale"]))
    assert tensors["layers.0.ffn.experts.3.w2.weight"].shape == (256, 128)
    assert torch.equal(tensors["layers.1.engram.embed.weight"], F.dequant_fp8_rows(ref["layers.1.engram.embed.weight"], ref["layers.1.engram.embed.scale"]))
    assert tensors["layers.0.hc_attn_fn"].dtype == torch.float32 and torch.equal(tensors["embed.weight"], ref["embed.weight"])


@needs_fixture
def test_load_into_fixture():
    ref = load_file(FIXTURE / "model.safetensors")
    loaded = load_into(targets(ref), FIXTURE, device="cpu", dtype_overrides={"head.weight": torch.float32})
    assert len(loaded) == 440 and loaded["head.weight"].dtype == torch.float32
    assert torch.equal(loaded["head.weight"], ref["head.weight"].float())
    assert loaded["layers.0.attn.wo_a.weight"].dtype == torch.bfloat16


def test_sharded_reading_with_scale_in_another_shard(tmp_path):
    stored = tiny_tensors()
    shard1 = {k: v for k, v in stored.items() if k.endswith(".scale") or k == "embed.weight"}
    shard2 = {k: v for k, v in stored.items() if k not in shard1}
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name, part in zip(names, (shard1, shard2)):
        save_file(part, tmp_path / name)
    weight_map = {k: names[0] for k in shard1} | {k: names[1] for k in shard2}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tensors = dict(CheckpointReader(tmp_path))
    assert sorted(tensors) == sorted(targets(stored))
    assert torch.equal(tensors["layers.0.attn.wq_a.weight"], F.dequant_fp8_block(stored["layers.0.attn.wq_a.weight"], stored["layers.0.attn.wq_a.scale"]))
    assert torch.equal(tensors["layers.0.ffn.experts.0.w1.weight"], F.dequant_mxfp4(stored["layers.0.ffn.experts.0.w1.weight"], stored["layers.0.ffn.experts.0.w1.scale"]))


def test_reader_streams_quantized_weights_in_chunks(tmp_path, monkeypatch):
    import dsflash_compile.checkpoint as C

    stored = tiny_tensors()
    save_file(stored, tmp_path / "model.safetensors")
    whole = dict(CheckpointReader(tmp_path))
    monkeypatch.setattr(C, "_READ_ELEMS", 100)  # one scale row (32 rows or 1 row) per chunk
    for name, t in CheckpointReader(tmp_path):
        assert torch.equal(t, whole[name]), name


def test_draft_and_vision_tensors_skipped_with_one_log_line(tmp_path, caplog):
    stored = tiny_tensors()
    extra = {
        "mtp.0.attn.wq_a.weight": stored["layers.0.attn.wq_a.weight"].clone(),
        "mtp.0.attn.wq_a.scale": stored["layers.0.attn.wq_a.scale"].clone(),
        "mtp.0.norm.weight": torch.ones(8, dtype=torch.bfloat16),
        "vision.patch_embed.weight": torch.ones(4, 4),
    }
    save_file(stored | extra, tmp_path / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="dsflash_compile.checkpoint"):
        reader = CheckpointReader(tmp_path)
    records = [r for r in caplog.records if r.name == "dsflash_compile.checkpoint"]
    assert len(records) == 1 and "skipped 4 tensors" in records[0].getMessage() and "mtp.*: 3" in records[0].getMessage()
    assert not any(n.startswith(("mtp.", "vision.")) for n in reader.names())
    assert sorted(load_into(targets(stored), tmp_path, device="cpu")) == sorted(targets(stored))


# ------------------------------------------------------------------------------------------ load_into errors


def write(tmp_path, tensors):
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_missing_tensors_all_listed(tmp_path):
    stored = tiny_tensors()
    want = targets(stored) | {"norm.weight": torch.empty(64, dtype=torch.bfloat16), "head.weight": torch.empty(16, 64, dtype=torch.bfloat16)}
    with pytest.raises(CheckpointError, match=r"missing 2 tensors: norm\.weight, head\.weight"):
        load_into(want, write(tmp_path, stored), device="cpu")


def test_unexpected_tensors(tmp_path):
    stored = tiny_tensors()
    want = targets(stored)
    del want["layers.0.attn.wq_a.weight"]
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensors: layers\.0\.attn\.wq_a\.weight"):
        load_into(want, write(tmp_path, stored), device="cpu")


def test_wrong_shape(tmp_path):
    stored = tiny_tensors()
    want = targets(stored)
    want["layers.0.ffn.experts.0.w1.weight"] = torch.empty(8, 32, dtype=torch.bfloat16, device="meta")
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.experts\.0\.w1\.weight: wrong shape: expected \[8, 32\], found \[8, 64\]"):
        load_into(want, write(tmp_path, stored), device="cpu")


def test_wrong_dtype_f16_for_bf16(tmp_path):
    stored = tiny_tensors()
    stored["embed.weight"] = stored["embed.weight"].half()
    with pytest.raises(CheckpointError, match=r"embed\.weight: wrong dtype: F16 .* torch\.bfloat16"):
        load_into(targets(tiny_tensors()), write(tmp_path, stored), device="cpu")


def test_wrong_dtype_fp8_without_scale(tmp_path):
    stored = tiny_tensors()
    del stored["layers.0.attn.wq_a.scale"]
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.weight: wrong dtype: F8_E4M3 weight without layers\.0\.attn\.wq_a\.scale"):
        load_into(targets(tiny_tensors()), write(tmp_path, stored), device="cpu")


def test_wrong_scale_shape(tmp_path):
    stored = tiny_tensors()
    stored["layers.0.attn.wq_a.scale"] = stored["layers.0.attn.wq_a.scale"][:1]
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.scale: wrong shape: expected \[2, 2\]"):
        CheckpointReader(write(tmp_path, stored))


def test_accepted_conversions(tmp_path):
    """hc_*_fn as BF16 into fp32, wo_a as plain bf16 (convert.py), F32 head into bf16 only if exact."""
    stored = tiny_tensors()
    stored["layers.0.hc_attn_fn"] = stored["layers.0.hc_attn_fn"].bfloat16()
    stored["layers.0.attn.wo_a.weight"] = torch.randn(32, 16).bfloat16()
    stored["head.weight"] = torch.randn(16, 64).bfloat16().float()
    loaded = load_into(targets(tiny_tensors()) | {
        "layers.0.attn.wo_a.weight": torch.empty(32, 16, dtype=torch.bfloat16, device="meta"),
        "head.weight": torch.empty(16, 64, dtype=torch.bfloat16, device="meta"),
    }, write(tmp_path, stored), device="cpu")
    assert loaded["layers.0.hc_attn_fn"].dtype == torch.float32
    assert torch.equal(loaded["layers.0.hc_attn_fn"], stored["layers.0.hc_attn_fn"].float())
    assert torch.equal(loaded["layers.0.attn.wo_a.weight"], stored["layers.0.attn.wo_a.weight"])
    assert torch.equal(loaded["head.weight"].float(), stored["head.weight"])

    stored["head.weight"] += 1e-4  # no longer bf16 values
    with pytest.raises(CheckpointError, match=r"head\.weight: wrong dtype: stored torch\.float32 values are not exactly representable"):
        load_into(targets(stored), write(tmp_path, stored), device="cpu", dtype_overrides={"head.weight": torch.bfloat16})


# ------------------------------------------------------------------------------------------ saving


@needs_fixture
def test_save_round_trip_single_file_is_bit_identical(tmp_path):
    tensors = dict(CheckpointReader(FIXTURE).items(keep_scales=True))
    save_checkpoint(tensors, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert_files_match_fixture(load_file(tmp_path / "model.safetensors"))


@needs_fixture
def test_save_round_trip_sharded_is_bit_identical(tmp_path):
    tensors = dict(CheckpointReader(FIXTURE).items(keep_scales=True))
    save_checkpoint(tensors, tmp_path, max_shard_bytes=2_000_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    written = {}
    for shard in shards:
        part = load_file(tmp_path / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        written |= part
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    for name in written:  # a weight and its scale share a shard
        if name.endswith(".scale"):
            assert index["weight_map"][name] == index["weight_map"][name[:-5] + "weight"]
    assert_files_match_fixture(written)
    assert sorted(dict(CheckpointReader(tmp_path))) == sorted(dict(CheckpointReader(FIXTURE)))


@needs_fixture
def test_save_without_scales_keeps_values(tmp_path):
    """Without the stored scales, scales are re-derived: same values (bytes may differ, see formats.py)."""
    tensors = dict(CheckpointReader(FIXTURE))
    save_checkpoint(tensors, tmp_path, max_shard_bytes=3_000_000)
    again = dict(CheckpointReader(tmp_path))
    assert sorted(again) == sorted(tensors)
    for name, t in tensors.items():
        assert same_bytes(again[name], t), name


def test_save_errors_name_the_tensor(tmp_path):
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.scale: scale given without"):
        save_checkpoint({"layers.0.attn.wq_a.scale": torch.ones(1, 1).to(F.E8M0)}, tmp_path)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.weight: .*clips"):
        save_checkpoint({"layers.0.attn.wq_a.weight": torch.full((32, 32), 1000.0),
                         "layers.0.attn.wq_a.scale": torch.ones(1, 1).to(F.E8M0)}, tmp_path)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mystery"):
        save_checkpoint({"layers.0.mystery": torch.ones(2)}, tmp_path)


def test_save_tied_and_float32_inputs(tmp_path):
    """Tensors sharing storage are fine; fp32 inputs are cast to the official dtype / quantized."""
    embed = torch.randn(16, 64).bfloat16()
    w = torch.randn(64, 64)
    save_checkpoint({"embed.weight": embed, "head.weight": embed, "layers.0.attn.wo_b.weight": w,
                     "layers.0.attn.wo_b.scale": F.quant_fp8_block(w)[1]}, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert torch.equal(stored["head.weight"], embed) and stored["layers.0.attn.wo_b.weight"].dtype == F.E4M3
    assert same_bytes(stored["layers.0.attn.wo_b.weight"], F.quant_fp8_block(w)[0])
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wo_b\.weight: an encoded fp8_block weight needs its"):
        save_checkpoint({"layers.0.attn.wo_b.weight": F.quant_fp8_block(w)[0]}, tmp_path)


def test_encoded_bytes_of_native_weights():
    """Shard sizing counts a weight held in its release format with its scales: packed MXFP4 [out, in/2]
    has one scale per 32 of its `in` inputs, FP8 one per 32x32 tile."""
    from dsflash_compile.checkpoint import _encoded_nbytes

    packed = torch.empty(64, 32, dtype=torch.int8)  # 64 inputs per row
    assert _encoded_nbytes("layers.0.ffn.experts.0.w1.weight", packed) == 64 * 32 + 64 * 2
    assert _encoded_nbytes("layers.0.attn.wq_a.weight", torch.empty(64, 64, dtype=torch.float8_e4m3fn)) == 64 * 64 + 4
