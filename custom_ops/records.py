"""Cache record formats (MODEL.md sections 6-7) and the ops that write and read them.

A record is the stored form of one cache row of `dim` values; a cache is uint8 [Bmax, N, record_bytes]
(or, for "bf16" only, bf16 [Bmax, N, dim]). Each quantized format stores exactly what the release's
quantize-dequantize point of that cache computes, so decode(encode(x)) equals the matching `quant` QDQ of
x bit for bit (CPU and CUDA), and encoding values already on a format's grid is value-exact:

  fmt      bytes for dim=d           QDQ it reproduces                   used for (MODEL.md 7)
  "bf16"   2d        (1024 @ 512)    identity on bf16 (RNE from fp32)    any cache, unquantized
  "fp8"    d + d/32  (528 @ 512)     quant.fp8_qdq(x, 32)                window ring (or compressed KV)
  "nvfp4"  d/2 + d/16 (288 @ 512)    quant.fp4_qdq_e4m3(x, 16)           compressed KV
  "mxfp4"  d/2 + d/32 (68 @ 128)     quant.fp4_qdq_ue8m0(x, 32)          index keys

Byte layouts (offsets within one record; groups are consecutive runs of the row, group g = values
[g*block, (g+1)*block)):

  "bf16":  bytes [2i, 2i+1] = bf16 bit pattern of value i, little-endian (low byte first). A bf16 cache
           tensor [.., dim] holds the same bytes on little-endian machines.
  "fp8":   bytes [0, d)         E4M3 code (float8_e4m3fn bits) of value i at byte i;
           bytes [d, d + d/32)  UE8M0 scale of group g (block 32) at byte d + g: scale = 2^(byte - 127).
           Per group: scale = quant.pow2_ceil_scale(max(amax, 1e-4), 1/448) (smallest power of two with
           amax <= 448 * scale, read off the fp32 bits of amax * fp32(1/448)); code = E4M3 round-to-
           nearest-even of clamp(x / scale, -448, 448). Value = e4m3(code) * scale.
  "nvfp4": bytes [0, d/2)       packed E2M1 codes: byte k holds value 2k in its LOW nibble and value
                                2k+1 in its high nibble; a nibble is sign (bit 3) + magnitude index (bits
                                0-2) into {0, 0.5, 1, 1.5, 2, 3, 4, 6};
           bytes [d/2, d/2+d/16) E4M3 scale of group g (block 16) at byte d/2 + g.
           Per group: scale = e4m3(min(max(amax, 6 * 2^-9) / 6, 448)) (RNE, so scale >= 2^-9 > 0);
           code = E2M1 round-half-even of clamp(x / scale, -6, 6) (ties 0.25, 1.25, 2.5, 5 go down, 0.75,
           1.75, 3.5 go up). Value = e2m1(code) * scale.
  "mxfp4": bytes [0, d/2)       packed E2M1 codes as "nvfp4";
           bytes [d/2, d/2+d/32) UE8M0 scale of group g (block 32) at byte d/2 + g.
           Per group: scale = quant.pow2_ceil_scale(max(amax, 6 * 2^-126), 1/6); code = E2M1 round-half-
           even of clamp(x / scale, -6, 6). Value = e2m1(code) * scale.

The sign of zero is kept (a negative value that rounds to zero stores code -0 and decodes to -0.0, as the
QDQ gives). UE8M0 bytes are decoded as the fp32 with that exponent field (byte << 23): 2^(byte - 127) for
bytes 1..254, which is all that finite inputs produce (the amax floors keep byte >= 1); 255 would read as
inf (pow2_ceil_scale's value for an infinite amax). Inputs are assumed finite; NaN/inf rows are not
specified. (Finite inputs can still decode to inf where the QDQ gives inf: an fp8 group at bf16's max has
codes 255 * 2^120 that round to 256 * 2^120 = 2^128.)

Ops (namespace dsflash, each with a fake kernel):
  record_write_(cache, rows, slots, fmt): cache[b, slots[b, s]] = encode(rows[b, s]) where slots >= 0.
      Reference: encode + scatter. CUDA: one Triton program per (b, s) row, quantized in registers; no host
      sync, no allocation (CUDA-graph safe; slots outside [0, N) are skipped there, while the reference
      raises for slots >= N).
  record_read(cache, fmt, dim) -> bf16 [..., dim]: decode whole records (reference only, CPU and CUDA).

Triton notes. The interpreter's (TRITON_INTERPRET=1) float casts are not IEEE: fp32 -> float8e4nv rounds half
away from zero and drops the mantissa carry (127.9 -> 64.0), fp32 -> bf16 does not round to nearest even,
and bf16 -> fp32 turns subnormals into other values (which mxfp4's tiny amax floor would expose). So the
kernel casts no float down or from bf16: bf16 rows are widened by shifting their bits, E4M3 codes and bf16
rounding are integer arithmetic on the fp32 bits (exact RNE, the same in the interpreter and on any GPU;
no sm_89 fp8 instructions needed). Division by the non-power-of-two nvfp4 scale uses tl.math.div_rn
(Triton's `/` on fp32 is approximate on NVIDIA); power-of-two scales are applied by multiplying with their
exact reciprocal. TRITON_INTERPRET must be set before triton is first imported (triton.language's own
tl.max is a @triton.jit function, fixed at that import), so the tests run the interpreter in a subprocess.
"""

import torch
from torch import Tensor

from ..formats import e2m1_to_float, float_to_e2m1, pack_e2m1, unpack_e2m1
from ..quant import _FP4_MAX_INV, _FP8_MAX_INV, FP4_MAX, FP8_MAX, fp8_quantize, pow2_ceil_scale

FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
_BLOCK = {"bf16": 1, "fp8": 32, "nvfp4": 16, "mxfp4": 32}  # values per scale
_FMT_ID = {"bf16": 0, "fp8": 1, "nvfp4": 2, "mxfp4": 3}  # the Triton kernel's constexpr
_FP8_AMAX_FLOOR = 1e-4
_NVFP4_AMAX_FLOOR = 6 * 2.0**-9
_MXFP4_AMAX_FLOOR = 6 * 2.0**-126
E4M3 = torch.float8_e4m3fn


def _check_format(fmt: str, dim: int) -> None:
    if fmt not in _BLOCK:
        raise ValueError(f"unknown record format {fmt!r}; expected one of {FORMATS}")
    block = _BLOCK[fmt]
    if not isinstance(dim, (int, torch.SymInt)) or isinstance(dim, bool) or dim <= 0 or dim % block:
        raise ValueError(f"record format {fmt!r} needs a positive dim that is a multiple of {block}, got {dim!r}")


def record_bytes(fmt: str, dim: int) -> int:
    """Bytes of one record of `dim` values: bf16 2d, fp8 d + d/32, nvfp4 d/2 + d/16, mxfp4 d/2 + d/32."""
    _check_format(fmt, dim)
    if fmt == "bf16":
        return 2 * dim
    if fmt == "fp8":
        return dim + dim // 32
    return dim // 2 + dim // _BLOCK[fmt]


# ----------------------------------------------------------------------------------------------------
# reference codecs (pure torch, vectorized, CPU and CUDA)


def _ue8m0_bytes(scale: Tensor) -> Tensor:
    """Power-of-two fp32 scales (pow2_ceil_scale's output) -> their exponent field as uint8."""
    return (scale.contiguous().view(torch.int32) >> 23).to(torch.uint8)


def _ue8m0_values(scale_bytes: Tensor) -> Tensor:
    """UE8M0 bytes -> fp32 2^(byte - 127), built from the exponent bits (the inverse of _ue8m0_bytes)."""
    return (scale_bytes.to(torch.int32) << 23).view(torch.float32)


def _e2m1_groups(g: Tensor, scale: Tensor) -> Tensor:
    """fp32 groups [..., n, block] / scale [..., n, 1] -> packed E2M1 bytes [..., n * block / 2]."""
    return pack_e2m1(float_to_e2m1((g / scale).clamp(-FP4_MAX, FP4_MAX)).flatten(-2))


def encode_reference(values: Tensor, fmt: str) -> Tensor:
    """Float values [..., dim] -> uint8 records [..., record_bytes(fmt, dim)] (layouts in the module doc)."""
    dim = values.shape[-1]
    _check_format(fmt, dim)
    if not values.is_floating_point():
        raise TypeError(f"encode_reference: expected floating-point values, got {values.dtype}")
    if fmt == "bf16":
        bits = values.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        return torch.stack([bits & 0xFF, bits >> 8], dim=-1).flatten(-2).to(torch.uint8)
    if fmt == "fp8":
        codes, scale = fp8_quantize(values, 32)  # the rule of quant.fp8_qdq itself
        return torch.cat([codes.view(torch.uint8), _ue8m0_bytes(scale)], dim=-1)
    g = values.float().unflatten(-1, (-1, _BLOCK[fmt]))
    if fmt == "nvfp4":  # quant.fp4_qdq_e4m3's rule
        amax = g.abs().amax(-1).clamp_min(_NVFP4_AMAX_FLOOR)
        scale = (amax / FP4_MAX).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
        return torch.cat([_e2m1_groups(g, scale.float().unsqueeze(-1)), scale.view(torch.uint8)], dim=-1)
    # mxfp4: quant.fp4_qdq_ue8m0's rule
    scale = pow2_ceil_scale(g.abs().amax(-1).clamp_min(_MXFP4_AMAX_FLOOR), _FP4_MAX_INV)
    return torch.cat([_e2m1_groups(g, scale.unsqueeze(-1)), _ue8m0_bytes(scale)], dim=-1)


def decode_reference(records: Tensor, fmt: str, dim: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """uint8 records [..., record_bytes(fmt, dim)] -> values [..., dim] in `dtype` (exact in bf16 and fp32)."""
    rb = record_bytes(fmt, dim)
    if records.dtype != torch.uint8 or records.shape[-1] != rb:
        raise ValueError(f"decode_reference: expected uint8 records [..., {rb}] for {fmt!r} x {dim}, "
                         f"got {records.dtype} {tuple(records.shape)}")
    if fmt == "bf16":
        bits = records[..., 0::2].to(torch.int32) | (records[..., 1::2].to(torch.int32) << 8)
        bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # two's complement int16 without overflow
        return bits.to(torch.int16).view(torch.bfloat16).to(dtype)
    block = _BLOCK[fmt]
    if fmt == "fp8":
        vals = records[..., :dim].contiguous().view(E4M3).float()
        scale = _ue8m0_values(records[..., dim:])
    else:
        vals = e2m1_to_float(unpack_e2m1(records[..., : dim // 2]))
        tail = records[..., dim // 2:]
        scale = tail.contiguous().view(E4M3).float() if fmt == "nvfp4" else _ue8m0_values(tail)
    # the same fp32 product as the QDQ (code value * scale), then one rounding to dtype
    return (vals.unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


# ----------------------------------------------------------------------------------------------------
# ops


def _bf16_cache(cache: Tensor, fmt: str) -> bool:
    """True for a bf16 [.., dim] cache (fmt "bf16" only), False for uint8 records; any other dtype raises."""
    if cache.dtype == torch.bfloat16 and fmt == "bf16":
        return True
    if cache.dtype != torch.uint8:
        raise TypeError(f"a {fmt!r} cache must be uint8 records" + (" or bf16" if fmt == "bf16" else "")
                        + f", got {cache.dtype}")
    return False


def _check_write(cache: Tensor, rows: Tensor, slots: Tensor, fmt: str) -> int:
    """Shape/dtype checks of record_write_ (metadata only: no device sync). Returns dim."""
    if cache.dim() != 3 or rows.dim() != 3 or slots.dim() != 2:
        raise ValueError(f"record_write_: expected cache [Bmax, N, rb], rows [B, S, dim], slots [B, S]; got "
                         f"{tuple(cache.shape)}, {tuple(rows.shape)}, {tuple(slots.shape)}")
    if tuple(slots.shape) != tuple(rows.shape[:2]) or rows.shape[0] > cache.shape[0]:
        raise ValueError(f"record_write_: slots {tuple(slots.shape)} must match rows {tuple(rows.shape)}[:2] "
                         f"and B <= Bmax = {cache.shape[0]}")
    if slots.dtype not in (torch.int64, torch.int32) or not rows.is_floating_point():
        raise TypeError(f"record_write_: slots must be int64/int32 and rows floating point, got {slots.dtype}, "
                        f"{rows.dtype}")
    dim = rows.shape[-1]
    _check_format(fmt, dim)
    expected = dim if _bf16_cache(cache, fmt) else record_bytes(fmt, dim)
    if cache.shape[-1] != expected:
        raise ValueError(f"record_write_: cache rows have {cache.shape[-1]} {cache.dtype} elements, expected "
                         f"{expected} for {fmt!r} records of {dim} values")
    return dim


def record_write_reference(cache: Tensor, rows: Tensor, slots: Tensor, fmt: str) -> None:
    _check_write(cache, rows, slots, fmt)
    b, t = (slots >= 0).nonzero(as_tuple=True)
    s = slots[b, t].long()
    if cache.dtype == torch.bfloat16:
        cache[b, s] = rows[b, t].to(torch.bfloat16)
    else:
        cache[b, s] = encode_reference(rows[b, t], fmt)


@torch.library.custom_op("dsflash::record_write_", mutates_args=("cache",))
def record_write_(cache: Tensor, rows: Tensor, slots: Tensor, fmt: str) -> None:
    """cache uint8 [Bmax, N, record_bytes(fmt, dim)] (or bf16 [Bmax, N, dim] for "bf16"); rows [B, S, dim]
    float (B <= Bmax); slots [B, S] int64: cache[b, slots[b, s]] = encode(rows[b, s], fmt) where >= 0."""
    record_write_reference(cache, rows, slots, fmt)


@record_write_.register_fake
def _(cache, rows, slots, fmt):
    _check_write(cache, rows, slots, fmt)
    return None


def record_read_reference(cache: Tensor, fmt: str, dim: int) -> Tensor:
    if _bf16_cache(cache, fmt):
        if cache.shape[-1] != dim:
            raise ValueError(f"record_read: bf16 cache rows have {cache.shape[-1]} values, expected {dim}")
        return cache.clone()
    return decode_reference(cache, fmt, dim, torch.bfloat16)


@torch.library.custom_op("dsflash::record_read", mutates_args=())
def record_read(cache: Tensor, fmt: str, dim: int) -> Tensor:
    """Records uint8 [..., record_bytes(fmt, dim)] (or a bf16 [..., dim] cache for "bf16") -> bf16 [..., dim]."""
    return record_read_reference(cache, fmt, dim)


@record_read.register_fake
def _(cache, fmt, dim):
    if not _bf16_cache(cache, fmt) and cache.shape[-1] != record_bytes(fmt, dim):
        raise ValueError(f"record_read: expected uint8 records [..., {record_bytes(fmt, dim)}], got "
                         f"{tuple(cache.shape)}")
    return cache.new_empty((*cache.shape[:-1], dim), dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------------------
# Triton write kernel (CUDA; also runs under TRITON_INTERPRET=1 on CPU tensors)

try:  # Triton is optional on CPU machines
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None


if triton is not None:  # defined only with triton (its annotations need tl)
    from .pdl import launch_options, pdl_wait
    from .bf16_bits import _bf16_as_f32, _f32_to_bf16

    # the QDQ constants, as the fp32 values the torch reference rounds them to
    _FP8_FLOOR = tl.constexpr(_FP8_AMAX_FLOOR)
    _FP8_INV = tl.constexpr(_FP8_MAX_INV)
    _NVFP4_FLOOR = tl.constexpr(_NVFP4_AMAX_FLOOR)
    _MXFP4_FLOOR = tl.constexpr(_MXFP4_AMAX_FLOOR)
    _FP4_INV = tl.constexpr(_FP4_MAX_INV)

    @triton.jit
    def _mxfp4_scale_byte(amax):
        """UE8M0 scale byte (int32) of groups with these fp32 amax values:
        quant.pow2_ceil_scale(max(amax, 6 * 2^-126), 1/6), the exponent field of the fp32 product, +1 if inexact."""
        pb = (tl.maximum(amax, _MXFP4_FLOOR) * _FP4_INV).to(tl.int32, bitcast=True)
        return ((pb >> 23) & 0xFF) + ((pb & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def _e2m1_magnitude(a):
        """|x| / scale (fp32, >= 0) -> the E2M1 magnitude index (int32, 0-7) by comparisons, round half to even
        (ties 0.25, 1.25, 2.5, 5 go down, 0.75, 1.75, 3.5 up), saturating at 6."""
        return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                + (a > 5.0).to(tl.int32))

    @triton.jit
    def _fp8_record(x):
        """An "fp8" record of rows of groups x fp32 [NG, 32]: (E4M3 codes int32 [NG, 32], UE8M0 scale bytes
        int32 [NG])."""
        ax = tl.abs(x)
        # pow2_ceil_scale(max(amax, 1e-4), 1/448): exponent field of the fp32 product, +1 if inexact
        pb = (tl.maximum(tl.max(ax, axis=1), _FP8_FLOOR) * _FP8_INV).to(tl.int32, bitcast=True)
        e = ((pb >> 23) & 0xFF) + ((pb & 0x7FFFFF) != 0).to(tl.int32)
        recip = ((254 - e) << 23).to(tl.float32, bitcast=True)  # exactly 1 / scale
        y = tl.minimum(ax * recip[:, None], 448.0)  # |x / scale| (exact), clamped
        # E4M3 round-to-nearest-even of y in [0, 448] from the fp32 bits (no fp8 cast, see module doc). Normal
        # range: round the 23-bit mantissa to 3 bits (a carry moves into the exponent), rebias 127 -> 7. Below
        # 2^-6 (subnormal codes k * 2^-9): y + 2^14 rounds y to a multiple of 2^-9 (RNE), and k is the ulp
        # count above 2^14. x / scale has x's sign (scale > 0), -0.0 included.
        yb = y.to(tl.int32, bitcast=True)
        normal = ((yb + 0x7FFFF + ((yb >> 20) & 1)) >> 20) - (120 << 3)
        sub = (y + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
        code = tl.where(y < 0.015625, sub, normal) | tl.where(x.to(tl.int32, bitcast=True) < 0, 0x80, 0)
        return code, e

    @triton.jit
    def _record_write_kernel(cache_ptr, rows_ptr, slots_ptr, S, N,
                             c_sb, c_sn, c_sd, r_sb, r_ss, r_sd, s_sb, s_ss,
                             DIM: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
                             NGP: tl.constexpr, DP: tl.constexpr, PDL: tl.constexpr):
        """One program per (b, s) row: quantize the row in registers and store its record at cache[b, slot]."""
        pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
        pid = tl.program_id(0).to(tl.int64)
        b = pid // S
        s = pid % S
        slot = tl.load(slots_ptr + b * s_sb + s * s_ss).to(tl.int64)
        ok = (slot >= 0) & (slot < N)
        src = rows_ptr + b * r_sb + s * r_ss
        dst = cache_ptr + b * c_sb + tl.where(ok, slot, 0) * c_sn
        if FMT == 0:  # bf16: the cache is bf16 [.., DIM]
            d = tl.arange(0, DP)
            m = (d < DIM) & ok
            x = tl.load(src + d * r_sd, mask=m, other=0.0)
            if x.dtype != tl.bfloat16:  # RNE to bf16 on the fp32 bits (the interpreter's cast is not RNE)
                x = _f32_to_bf16(x.to(tl.float32))
            tl.store(dst + d * c_sd, x, mask=m)
        else:  # quantized: the row as NG groups of G values, one group per tile row
            gi = tl.arange(0, NGP)
            off = gi[:, None] * G + tl.arange(0, G)[None, :]
            m = (gi[:, None] < NG) & ok
            x = tl.load(src + off * r_sd, mask=m, other=0.0)
            if x.dtype == tl.bfloat16:  # exact upcast from the bits (the interpreter's cast mangles subnormals)
                x = _bf16_as_f32(x)
            else:
                x = x.to(tl.float32)
            _store_groups(dst, c_sd, x, m, (gi < NG) & ok, DIM, FMT, G, NGP)

    @triton.jit
    def _store_groups(dst, c_sd, x, m, gm, DIM: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr,
                      NGP: tl.constexpr):
        """One row's record of a quantized format FMT (records' id: 1 fp8, 2 nvfp4, 3 mxfp4) stored at dst (element
        stride c_sd): x fp32 [NGP, G], the row's groups of G values a tile row, m [NGP, G] / gm [NGP] the groups
        stored (the row's, and only where it is written)."""
        gi = tl.arange(0, NGP)
        if FMT == 1:  # fp8: DIM E4M3 codes, then NG UE8M0 scales (G = 32)
            code, e = _fp8_record(x)
            tl.store(dst + (gi[:, None] * G + tl.arange(0, G)[None, :]) * c_sd, code.to(tl.uint8), mask=m)
            tl.store(dst + (DIM + gi) * c_sd, e.to(tl.uint8), mask=gm)
        else:  # nvfp4 (G = 16, E4M3 scales) / mxfp4 (G = 32, UE8M0 scales): DIM/2 packed bytes, NG scales
            ax = tl.abs(x)
            amax = tl.max(ax, axis=1)
            sign = x.to(tl.int32, bitcast=True) < 0  # x / scale has x's sign (scale > 0), -0.0 included
            if FMT == 2:
                # scale = e4m3(min(max(amax, 6 * 2^-9) / 6, 448)) (>= 2^-9), E4M3 RNE as _fp8_record rounds
                y = tl.minimum(tl.math.div_rn(tl.maximum(amax, _NVFP4_FLOOR), 6.0), 448.0)
                yb = y.to(tl.int32, bitcast=True)
                rn = (yb + 0x7FFFF + ((yb >> 20) & 1)) >> 20
                sub = (y + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
                is_sub = y < 0.015625
                sbyte = tl.where(is_sub, sub, rn - (120 << 3))
                scale = tl.where(is_sub, sub.to(tl.float32) * 0.001953125, (rn << 20).to(tl.float32, bitcast=True))
                a = tl.math.div_rn(ax, scale[:, None])  # correctly rounded, as torch's division
            else:
                sbyte = _mxfp4_scale_byte(amax)
                a = ax * ((254 - sbyte) << 23).to(tl.float32, bitcast=True)[:, None]  # exactly |x| / scale
            code = _e2m1_magnitude(a) | tl.where(sign, 8, 0)  # bit 3 = sign
            even, odd = tl.split(tl.reshape(code, (NGP, G // 2, 2)))
            k = tl.arange(0, G // 2)
            tl.store(dst + (gi[:, None] * (G // 2) + k[None, :]) * c_sd, (even | (odd << 4)).to(tl.uint8),
                     mask=gm[:, None])  # element 2k in the low nibble
            tl.store(dst + (DIM // 2 + gi) * c_sd, sbyte.to(tl.uint8), mask=gm)


def kernel_view(cache: Tensor, fmt: str) -> Tensor:
    """The cache as the Triton kernels index it: "bf16" records held as uint8 viewed as bf16 (the same bytes,
    little-endian, 2 a value), any other cache as it is."""
    return cache.view(torch.bfloat16) if fmt == "bf16" and cache.dtype == torch.uint8 else cache


def record_write_triton(cache: Tensor, rows: Tensor, slots: Tensor, fmt: str) -> None:
    """The Triton implementation of record_write_ (same arguments). Launch only: no sync, no allocation.

    Unlike the reference, slots >= N are skipped rather than rejected (no device-side checks).
    """
    if triton is None:
        raise RuntimeError("record_write_triton needs triton")
    dim = _check_write(cache, rows, slots, fmt)
    batch, seq = slots.shape
    if batch * seq == 0:
        return
    cache = kernel_view(cache, fmt)
    block = _BLOCK[fmt]
    groups = dim // block
    _record_write_kernel[(batch * seq,)](
        cache, rows, slots, seq, cache.shape[1],
        cache.stride(0), cache.stride(1), cache.stride(2), rows.stride(0), rows.stride(1), rows.stride(2),
        slots.stride(0), slots.stride(1),
        DIM=dim, FMT=_FMT_ID[fmt], G=block, NG=groups, NGP=triton.next_power_of_2(groups),
        DP=triton.next_power_of_2(dim), num_warps=4 if dim >= 256 else 2, **launch_options(cache.device),
    )


if triton is not None:
    @record_write_.register_kernel("cuda")
    def _(cache, rows, slots, fmt):
        record_write_triton(cache, rows, slots, fmt)

