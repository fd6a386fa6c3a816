"""Codecs of dsflash_compile.formats: E2M1, UE8M0, FP8 block / rows, MXFP4 (CPU, exact)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsflash_compile import formats as F

FIXTURE = Path(__file__).resolve().parents[1].parent / "shared" / "golden" / "tiny-a"
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def u8(t):
    return t.view(torch.uint8)


# ------------------------------------------------------------------------------------------ E2M1


def test_e2m1_code_value_table():
    codes = torch.arange(16, dtype=torch.uint8)
    values = F.e2m1_to_float(codes)
    assert values.tolist() == E2M1_VALUES + [-v for v in E2M1_VALUES]
    assert torch.signbit(values[8])  # code 8 is -0.0
    assert torch.equal(F.float_to_e2m1(values), codes)  # every code round trips, -0.0 included


def test_pack_unpack_nibble_order():
    packed = F.pack_e2m1(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8))
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x0F]]  # element 2k in the low nibble
    assert F.unpack_e2m1(packed.view(torch.int8)).tolist() == [[1, 2, 15, 0]]
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    assert torch.equal(F.unpack_e2m1(F.pack_e2m1(codes)), codes)
    with pytest.raises(ValueError, match="even"):
        F.pack_e2m1(codes[:, :3])
    with pytest.raises(TypeError, match="int8"):
        F.unpack_e2m1(codes.float())


def test_round_to_e2m1_ties_to_even_code_and_saturation():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert F.round_to_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert F.round_to_e2m1(-ties).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    big = torch.tensor([6.0, 6.5, 100.0, float("inf"), -7.0, -float("inf")])
    assert F.round_to_e2m1(big).tolist() == [6.0, 6.0, 6.0, 6.0, -6.0, -6.0]
    out = F.round_to_e2m1(torch.tensor([float("nan"), -0.1], dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out[0].isnan() and out[1] == 0 and torch.signbit(out[1])


def test_round_to_e2m1_is_nearest():
    x = torch.randn(100_000) * 3
    grid = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES[1:]])
    nearest_dist = (x[:, None].clamp(-6, 6) - grid).abs().min(dim=1).values
    assert torch.equal((F.round_to_e2m1(x) - x.clamp(-6, 6)).abs(), nearest_dist)


# ------------------------------------------------------------------------------------------ UE8M0


def test_e8m0_exact_both_ways():
    codes = torch.arange(255, dtype=torch.uint8).view(F.E8M0)
    for dtype in (torch.float32, torch.bfloat16):
        values = F.e8m0_to_float(codes, dtype)
        assert values.tolist() == [2.0 ** (i - 127) for i in range(255)]
        assert torch.equal(u8(F.float_to_e8m0(values)), u8(codes))
    assert F.e8m0_to_float(torch.tensor([255], dtype=torch.uint8).view(F.E8M0)).isnan().all()
    with pytest.raises(ValueError, match="powers of two"):
        F.float_to_e8m0(torch.tensor([3.0]))


def test_ue8m0_scale_rule():
    amax = torch.tensor([448.0, 448.00003, 224.0, 1.0, 0.0])
    assert F.ue8m0_scale(amax, 448).tolist() == [1.0, 2.0, 0.5, 2.0**-8, 1.0]  # amax == 0 -> 1.0
    assert F.ue8m0_scale(torch.tensor([6.0, 3.0, 3.01]), 6).tolist() == [1.0, 0.5, 1.0]
    assert F.ue8m0_scale(torch.tensor([0.0]), 448, amax_floor=1e-4).tolist() == [2.0**-22]
    x = torch.randn(10_000).abs().bfloat16().float() * torch.exp2(torch.randint(-30, 30, (10_000,)).float())
    for m in (448.0, 6.0):  # same as the float formula for bf16 amax (no division rounding across 2^k)
        assert torch.equal(F.ue8m0_scale(x, m), torch.exp2(torch.ceil(torch.log2(x / m))))


# ------------------------------------------------------------------------------------------ weights


def test_fp8_block_ragged_shapes_and_minimal_scale():
    w = (torch.randn(45, 70) * 0.02).bfloat16()
    q, s = F.quant_fp8_block(w)
    assert q.dtype == F.E4M3 and q.shape == (45, 70) and s.dtype == F.E8M0 and s.shape == (2, 3)
    scale = F.e8m0_to_float(s)
    naive = q.float() * scale.repeat_interleave(32, 0)[:45].repeat_interleave(32, 1)[:, :70]
    deq = F.dequant_fp8_block(q, s)
    assert deq.dtype == torch.bfloat16 and torch.equal(deq.float(), naive)
    tile_amax = torch.zeros(2, 3)
    for i in range(2):
        for j in range(3):
            tile_amax[i, j] = w[32 * i : 32 * i + 32, 32 * j : 32 * j + 32].float().abs().max()
    assert torch.equal(scale, torch.exp2(torch.ceil(torch.log2(tile_amax / 448))))
    q2, s2 = F.quant_fp8_block(deq)  # values on the grid: quantization is lossless
    assert torch.equal(F.dequant_fp8_block(q2, s2), deq)


def test_fp8_rows_and_mxfp4_round_trip():
    w = torch.randn(33, 64).bfloat16()
    q, s = F.quant_fp8_rows(w)
    assert s.shape == (33, 2)
    deq = F.dequant_fp8_rows(q, s)
    assert torch.equal(F.dequant_fp8_rows(*F.quant_fp8_rows(deq)), deq)
    q, s = F.quant_mxfp4(w)
    assert q.dtype == torch.int8 and q.shape == (33, 32) and s.shape == (33, 2)
    deq = F.dequant_mxfp4(q, s)
    assert torch.equal(deq.float(), F.round_to_e2m1(w.float() / F.e8m0_to_float(s).repeat_interleave(32, 1)) * F.e8m0_to_float(s).repeat_interleave(32, 1))
    assert torch.equal(F.dequant_mxfp4(*F.quant_mxfp4(deq)), deq)


def test_chunked_paths_match(monkeypatch):
    w = torch.randn(200, 96).bfloat16()
    codecs = [(F.quant_fp8_block, F.dequant_fp8_block), (F.quant_fp8_rows, F.dequant_fp8_rows), (F.quant_mxfp4, F.dequant_mxfp4)]
    ref = [(quant(w), dequant(*quant(w))) for quant, dequant in codecs]
    monkeypatch.setattr(F, "_CHUNK_ELEMS", 1000)  # many chunks of 32 or 10 rows, ragged last chunk
    for (quant, dequant), ((q, s), deq) in zip(codecs, ref):
        q2, s2 = quant(w)
        assert torch.equal(u8(q2), u8(q)) and torch.equal(u8(s2), u8(s))
        assert torch.equal(dequant(q, s), deq)


def test_errors_name_the_problem():
    q, s = F.quant_fp8_block(torch.randn(64, 64))
    with pytest.raises(TypeError, match="expected dtype torch.float8_e4m3fn"):
        F.dequant_fp8_block(q.float(), s)
    with pytest.raises(ValueError, match=r"scale has shape \(2, 1\), expected \(2, 2\)"):
        F.dequant_fp8_block(q, s[:, :1])
    with pytest.raises(ValueError, match="2-D"):
        F.quant_fp8_block(torch.randn(64))
    with pytest.raises(ValueError, match="clips"):
        F.quant_fp8_block(torch.full((64, 64), 1000.0), scale=s)
    with pytest.raises(TypeError, match="int8"):
        F.dequant_mxfp4(q, s)


# ------------------------------------------------------------------------------------------ fixture


@pytest.mark.skipif(not (FIXTURE / "model.safetensors").exists(), reason=f"golden fixture not found at {FIXTURE}")
def test_fixture_weights_requantize_bit_identically():
    sd = load_file(FIXTURE / "model.safetensors")
    codecs = {"block": (F.dequant_fp8_block, F.quant_fp8_block), "rows": (F.dequant_fp8_rows, F.quant_fp8_rows), "mxfp4": (F.dequant_mxfp4, F.quant_mxfp4)}
    seen = set()
    for name, scale in sd.items():
        if not name.endswith(".scale"):
            continue
        weight = sd[name[: -len("scale")] + "weight"]
        kind = "mxfp4" if weight.dtype == torch.int8 else "rows" if ".engram.embed." in name else "block"
        dequant, quant = codecs[kind]
        seen.add(kind)
        values = dequant(weight, scale)
        assert values.dtype == torch.bfloat16 and torch.equal(dequant(weight, scale, torch.float32), values.float())

        # With the stored scale the bytes come back exactly.
        w2, s2 = quant(values, scale=scale)
        assert torch.equal(u8(w2), u8(weight)) and torch.equal(u8(s2), u8(scale)), name

        # Re-deriving the scale from the values gives the same values, and the same bytes except for groups
        # whose largest code is the bottom of the range (e4m3 224, E2M1 3): there the smallest non-clipping
        # scale is half the stored one (codes doubled). Values alone cannot tell the two encodings apart.
        w3, s3 = quant(values)
        assert torch.equal(dequant(w3, s3), values), name
        if kind == "mxfp4":
            group_max = F.e2m1_to_float(F.unpack_e2m1(weight)).abs().view(scale.shape[0], -1, 32).amax(-1)
            bottom = group_max == 3.0
        elif kind == "rows":
            bottom = weight.float().abs().view(scale.shape[0], -1, 32).amax(-1) == 224.0
        else:
            bottom = F._group_amax(weight.float(), 32) == 224.0
        stored, derived = F.e8m0_to_float(scale), F.e8m0_to_float(s3)
        assert torch.equal(derived[~bottom], stored[~bottom]) and torch.equal(derived[bottom], stored[bottom] / 2), name
    assert seen == {"block", "rows", "mxfp4"}
