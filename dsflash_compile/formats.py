"""Exact codecs for the storage formats of the DeepSeek-V4.1-Flash release (pure torch, CPU and CUDA).

Formats (shared/golden/tiny-a/README.md, "Checkpoint naming and formats"; shared/spec/MODEL.md section 6):
  - E2M1 (FP4): 4-bit code, bit 3 = sign, bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
    Two codes per byte: element 2k in the LOW nibble, 2k+1 in the high nibble.
  - UE8M0: one byte, value 2^(byte - 127) (byte 255 = NaN); torch.float8_e8m0fnu.
  - FP8 E4M3: torch.float8_e4m3fn (max 448, no inf).
Weight layouts (value = code * scale of its group):
  - fp8 block: e4m3 [out, in] + ue8m0 [ceil(out/32), ceil(in/32)], one scale per 32x32 tile.
  - fp8 rows:  e4m3 [rows, d] + ue8m0 [rows, ceil(d/32)], one scale per 32 values of a row (Engram table).
  - mxfp4:     packed E2M1 int8 [out, in/2] + ue8m0 [out, ceil(in/32)], one scale per 32 inputs of a row.

Dequantization is exact in bf16: an e4m3 value has 4 significant bits and an E2M1 value 2, bf16 has 8,
and multiplying by a power of two only moves the exponent. (The product stays inside bf16's range for any
scale exponent >= -124; real weights use exponents around -10.)

Quantization picks, per group, the smallest power-of-two scale that avoids clipping (`ue8m0_scale`).
Caveat: that rule is a function of the group's amax only, while a stored group whose largest code is at
the bottom of the range (e4m3 224, E2M1 3) has the same values as the group with half the scale and
doubled codes. The release (and the fixture) chose scales from the unquantized weights, so re-deriving
the scale from dequantized values gives back the same VALUES but, for such groups, different bytes.
To reproduce bytes exactly, pass the original scale (`scale=`): codes are then bit-identical.

Large tensors (the Engram table is ~384M x 256) are processed in chunks of rows so that fp32/int
temporaries stay small (_CHUNK_ELEMS elements per chunk).
"""

import math

import torch

BLOCK = 32  # group size of every scale in the release (32x32 tiles, 32 values of a row)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0 = torch.float8_e8m0fnu
E4M3 = torch.float8_e4m3fn

_CHUNK_ELEMS = 1 << 22  # ~4M elements per chunk: a few 16 MB temporaries at most


# ----------------------------------------------------------------------------------------------------
# E2M1 (FP4)


def e2m1_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (integer tensor, 0..15; higher bits ignored) -> values in `dtype` (code 8 is -0.0)."""
    # arithmetic, not a lookup table: a table made on the fly is a host-to-device copy, which CUDA graph
    # capture forbids (and an eager launch pays each call)
    code = codes.to(torch.int32)
    exponent, half = (code & 7) >> 1, (code & 1).to(dtype) / 2  # code 1eeh: 2^(e-1) * (1 + h/2); e = 0: h/2
    magnitude = torch.where(exponent == 0, half, (1 + half) * torch.exp2((exponent - 1).to(dtype)))
    return torch.where((code & 8) != 0, -magnitude, magnitude)


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> uint8 E2M1 codes, round to nearest, ties to the even code, saturating at +-6.

    Ties to even code = IEEE round-half-even on E2M1: the midpoints 0.25, 1.25, 2.5, 5 round down (to the
    even codes 0, 2, 4, 6 = values 0, 1, 2, 4) and 0.75, 1.75, 3.5 round up (to codes 2, 4, 6 = 1, 2, 4).
    The sign comes from the sign bit, so -0.0 and negatives that round to zero give code 8 (-0).
    NaN gives +-0 (E2M1 has no NaN); `round_to_e2m1` keeps NaN instead.
    """
    a = x.abs()
    mag = (a > 0.25).to(torch.uint8)  # to code 1 (odd): ties stay below
    mag += a >= 0.75  # to code 2 (even): ties go up
    mag += a > 1.25
    mag += a >= 1.75
    mag += a > 2.5
    mag += a >= 3.5
    mag += a > 5.0  # anything above 5 (including > 6 and inf) saturates at code 7 = 6.0
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Value-level E2M1 rounding: nearest of {0, +-0.5, ..., +-6}, ties to even code, saturating at +-6.

    Same dtype and shape as `x`; NaN stays NaN. Used for activation quantize-dequantize (x / scale first).
    """
    y = e2m1_to_float(float_to_e2m1(x), x.dtype)
    return torch.where(torch.isnan(x), x, y)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., 2n] -> uint8 [..., n]; element 2k in the low nibble, 2k+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dimension must be even, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8) & 15
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes (int8, uint8 or float4_e2m1fn_x2) [..., n] -> uint8 codes [..., 2n]."""
    if packed.dtype not in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
        raise TypeError(f"unpack_e2m1: expected int8/uint8 packed codes, got {packed.dtype}")
    p = packed.view(torch.uint8)
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------------
# UE8M0 scales


def e8m0_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e8m0fnu -> 2^(byte-127) in `dtype` (exact in fp32 and bf16, incl. 2^-127; byte 255 -> NaN)."""
    _expect_dtype(scale, E8M0, "scale")
    return scale.to(dtype)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Powers of two in [2^-127, 2^127] -> float8_e8m0fnu, exactly. Anything else is an error."""
    mant, exp = torch.frexp(scale.float())  # scale = mant * 2^exp, mant in [0.5, 1)
    ok = (mant == 0.5) & (exp >= -126) & (exp <= 128)
    if not bool(ok.all()):
        bad = scale.float()[~ok][:4].tolist()
        raise ValueError(f"float_to_e8m0: scales must be powers of two in [2^-127, 2^127], got e.g. {bad}")
    return (exp + 126).to(torch.uint8).view(E8M0)


def ue8m0_scale(amax: torch.Tensor, max_code: float, amax_floor: float = 0.0) -> torch.Tensor:
    """Smallest power of two s with amax <= max_code * s, i.e. 2^ceil(log2(amax / max_code)), as fp32.

    Computed exactly (frexp + one correction step, no log2 rounding). `amax` is first raised to
    `amax_floor` (the release floors FP8 activation amax at 1e-4). A group with amax == 0 (after the floor)
    gets scale 1.0: every scale encodes zeros exactly, and 1.0 keeps the exponent neutral.
    The exponent is clamped to UE8M0's range [-127, 127].
    """
    amax = amax.float().clamp_min(amax_floor).double()  # float64: 2^k stays exact below fp32's range
    _, k = torch.frexp(amax / max_code)  # amax/max_code < 2^k, up to the rounding of the division
    k = torch.where(amax <= max_code * _pow2(k - 1), k - 1, k)  # the ratio was exactly 2^(k-1)
    k = torch.where(amax > max_code * _pow2(k), k + 1, k)  # the division rounded down across 2^k
    k = torch.where(amax == 0, 0, k)
    k = torch.where(torch.isinf(amax), 127, k).clamp(-127, 127)
    return _pow2(k).float()


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact 2^k as float64 for integer k in [-1022, 1023], built from the exponent bits."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


# ----------------------------------------------------------------------------------------------------
# shared helpers


def _expect_dtype(t: torch.Tensor, dtypes, what: str) -> None:
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        raise TypeError(f"{what}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")


def _expect_2d(t: torch.Tensor, what: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D tensor, got shape {tuple(t.shape)}")


def _expect_scale_shape(scale: torch.Tensor, expected, weight_shape, layout: str) -> None:
    if tuple(scale.shape) != tuple(expected):
        raise ValueError(
            f"scale has shape {tuple(scale.shape)}, expected {tuple(expected)} for weight "
            f"{tuple(weight_shape)} ({layout})"
        )


def _row_chunks(rows: int, cols: int, multiple: int):
    """Row ranges [r0, r1) of about _CHUNK_ELEMS elements, r0 a multiple of `multiple`."""
    step = max(multiple, (_CHUNK_ELEMS // max(cols, 1)) // multiple * multiple)
    for r0 in range(0, rows, step):
        yield r0, min(r0 + step, rows)


def _expand(scale: torch.Tensor, rows: int, cols: int, bh: int) -> torch.Tensor:
    """Per-group scales [ceil(rows/bh), ceil(cols/32)] -> per-element [rows, cols]."""
    return scale.repeat_interleave(bh, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def _group_amax(x: torch.Tensor, bh: int) -> torch.Tensor:
    """|x| max over groups of bh rows x 32 columns (ragged edges padded with zeros)."""
    rows, cols = x.shape
    gr, gc = math.ceil(rows / bh), math.ceil(cols / BLOCK)
    a = x.new_zeros(gr * bh, gc * BLOCK)
    a[:rows, :cols] = x.abs()
    return a.view(gr, bh, gc, BLOCK).amax(dim=(1, 3))


def _scale_shape(rows: int, cols: int, bh: int):
    return (math.ceil(rows / bh), math.ceil(cols / BLOCK))


def _dequant(codes_to_values, weight, scale, cols: int, bh: int, dtype) -> torch.Tensor:
    """Shared loop: out[rows, cols] = values(weight rows) * expanded scale, chunk by chunk."""
    rows = weight.shape[0]
    out = torch.empty(rows, cols, dtype=dtype, device=weight.device)
    for r0, r1 in _row_chunks(rows, cols, bh):
        s = e8m0_to_float(scale[r0 // bh : math.ceil(r1 / bh)], dtype)
        torch.mul(codes_to_values(weight[r0:r1]), _expand(s, r1 - r0, cols, bh), out=out[r0:r1])
    return out


def _quant(encode, out, weight, scale, bh: int, max_code: float, what: str):
    """Shared loop: pick (or check) the scales per group, then out[rows] = encode(weight / scale), chunked.

    Returns (out, e8m0 scale). The given `scale` must not clip: that would silently change values.
    """
    rows, cols = weight.shape
    sshape = _scale_shape(rows, cols, bh)
    if scale is not None:
        _expect_dtype(scale, E8M0, f"{what} scale")
        _expect_scale_shape(scale, sshape, weight.shape, what)
    e8m0 = torch.empty(sshape, dtype=E8M0, device=weight.device)
    for r0, r1 in _row_chunks(rows, cols, bh):
        g0, g1 = r0 // bh, math.ceil(r1 / bh)
        x = weight[r0:r1].float()  # exact widening; the division by a power of two below is exact too
        needed = ue8m0_scale(_group_amax(x, bh), max_code)
        if scale is None:
            s = needed
        else:
            s = e8m0_to_float(scale[g0:g1])
            if bool((needed > s).any()):
                raise ValueError(f"{what}: the given scale clips values in rows {r0}..{r1 - 1} (|x| > {max_code} * scale)")
        out[r0:r1] = encode((x / _expand(s, r1 - r0, cols, bh)).clamp_(-max_code, max_code))
        e8m0[g0:g1] = float_to_e8m0(s)
    return out, e8m0


def _encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(E4M3)  # round to nearest even; x is already clamped to +-448 (CUDA casts need not saturate)


# ----------------------------------------------------------------------------------------------------
# FP8 E4M3 weights: 32x32 tiles (projections) and per-row groups of 32 (Engram table)


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e4m3 [out, in] * ue8m0 [ceil(out/32), ceil(in/32)] (32x32 tiles) -> `dtype` (exact in bf16/fp32)."""
    _expect_dtype(weight, E4M3, "fp8 block weight")
    _expect_dtype(scale, E8M0, "fp8 block scale")
    _expect_2d(weight, "fp8 block weight")
    _expect_scale_shape(scale, _scale_shape(*weight.shape, BLOCK), weight.shape, "32x32 tiles")
    return _dequant(lambda w: w.to(dtype), weight, scale, weight.shape[1], BLOCK, dtype)


def quant_fp8_block(weight: torch.Tensor, scale: torch.Tensor | None = None):
    """Float [out, in] -> (e4m3 [out, in], ue8m0 [ceil(out/32), ceil(in/32)]).

    Per 32x32 tile, scale = 2^ceil(log2(amax / 448)) unless `scale` is given (it must not clip).
    """
    _expect_2d(weight, "fp8 block weight")
    out = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
    return _quant(_encode_e4m3, out, weight, scale, BLOCK, FP8_MAX, "fp8 block weight")


def dequant_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e4m3 [rows, d] * ue8m0 [rows, ceil(d/32)] (per-row groups of 32) -> `dtype` (exact in bf16/fp32)."""
    _expect_dtype(weight, E4M3, "fp8 rows weight")
    _expect_dtype(scale, E8M0, "fp8 rows scale")
    _expect_2d(weight, "fp8 rows weight")
    _expect_scale_shape(scale, _scale_shape(*weight.shape, 1), weight.shape, "per-row groups of 32")
    return _dequant(lambda w: w.to(dtype), weight, scale, weight.shape[1], 1, dtype)


def lookup_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [...] of an fp8-rows table (the Engram table), dequantized to bf16 [..., d]: each code times its
    group's scale in fp32, rounded once (exact for the release's scales). Gathers first, so a lookup of a few rows
    reads only those (traceable: no chunk loop, unlike dequant_fp8_rows)."""
    values = weight[ids].float().unflatten(-1, (-1, BLOCK)) * scale[ids].float().unsqueeze(-1)
    return values.flatten(-2).to(torch.bfloat16)


def quant_fp8_rows(weight: torch.Tensor, scale: torch.Tensor | None = None):
    """Float [rows, d] -> (e4m3 [rows, d], ue8m0 [rows, ceil(d/32)]); scale rule as quant_fp8_block."""
    _expect_2d(weight, "fp8 rows weight")
    out = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
    return _quant(_encode_e4m3, out, weight, scale, 1, FP8_MAX, "fp8 rows weight")


# ----------------------------------------------------------------------------------------------------
# MXFP4 weights (routed experts): packed E2M1 + one UE8M0 scale per 32 inputs of a row


def dequant_mxfp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Packed E2M1 int8 [out, in/2] * ue8m0 [out, ceil(in/32)] -> `dtype` [out, in] (exact in bf16/fp32)."""
    _expect_dtype(weight, (torch.int8, torch.uint8), "mxfp4 weight")
    _expect_dtype(scale, E8M0, "mxfp4 scale")
    _expect_2d(weight, "mxfp4 weight")
    cols = 2 * weight.shape[1]
    _expect_scale_shape(scale, _scale_shape(weight.shape[0], cols, 1), (weight.shape[0], cols), "32 inputs per scale")
    return _dequant(lambda w: e2m1_to_float(unpack_e2m1(w), dtype), weight, scale, cols, 1, dtype)


def quant_mxfp4(weight: torch.Tensor, scale: torch.Tensor | None = None):
    """Float [out, in] (in even) -> (int8 [out, in/2] packed E2M1, ue8m0 [out, ceil(in/32)]).

    Per 32 inputs of a row, scale = 2^ceil(log2(amax / 6)) unless `scale` is given (it must not clip).
    """
    _expect_2d(weight, "mxfp4 weight")
    if weight.shape[1] % 2:
        raise ValueError(f"mxfp4 weight: input dimension must be even, got shape {tuple(weight.shape)}")
    out = torch.empty(weight.shape[0], weight.shape[1] // 2, dtype=torch.int8, device=weight.device)
    encode = lambda x: pack_e2m1(float_to_e2m1(x)).view(torch.int8)  # the checkpoint stores I8
    return _quant(encode, out, weight, scale, 1, E2M1_MAX, "mxfp4 weight")
