"""Triton kernel of `dsflash::rope_fp4_qdq_` (see rope_fp4_qdq.py for the math): one program per (token, block
of heads), about 1024 values each (the release's indexer query, 32 heads x 128: 4 programs a token).

A program loads its heads' rows, rotates the trailing pairs (rope_tail_triton's arithmetic: other pairs pass
through untouched, so a -0.0 stays -0.0), rounds them to bf16, then quantize-dequantizes each group of 32 as
quant.fp4_qdq_ue8m0 with records.py's MXFP4 scale and E2M1 rounding, and writes the rows back. Every rounding
is integer arithmetic on the fp32 bits (bf16 in and out through routed_experts_triton's helpers), which the
interpreter runs as the GPU does.
"""

import triton
import triton.language as tl

from .bf16_bits import _bf16_as_f32, _f32_to_bf16, _round_bf16
from .pdl import launch_options, pdl_wait
from .records import _e2m1_magnitude, _mxfp4_scale_byte

VALUES_PER_PROGRAM = 1024


@triton.jit
def _rope_fp4_qdq_kernel(x_ptr, rot_ptr, H, D, HEADS: tl.constexpr, DP: tl.constexpr, PAIRS: tl.constexpr,
                         PDL: tl.constexpr):
    """x [N, H, D] contiguous (tokens, heads), D a multiple of 32 (DP: its power of two), rot [N, PAIRS, 2]."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    col = tl.arange(0, DP)
    live = (h < H)[:, None] & (col < D)[None, :]
    at = x_ptr + (tok * H + h[:, None]) * D + col[None, :]
    v = _bf16_as_f32(tl.load(at, mask=live, other=0.0))
    even, odd = tl.split(tl.reshape(v, (HEADS, DP // 2, 2)))
    r = tl.arange(0, DP // 2) - (D // 2 - PAIRS)  # the rope pair of each pair of columns, if in [0, PAIRS)
    rope = (r >= 0) & (r < PAIRS)
    cos = tl.load(rot_ptr + tok * 2 * PAIRS + 2 * r, mask=rope, other=1.0)[None, :]
    sin = tl.load(rot_ptr + tok * 2 * PAIRS + 2 * r + 1, mask=rope, other=0.0)[None, :]
    even, odd = (tl.where(rope[None, :], _round_bf16(even * cos - odd * sin), even),
                 tl.where(rope[None, :], _round_bf16(even * sin + odd * cos), odd))
    g = tl.reshape(tl.join(even, odd), (HEADS, DP // 32, 32))
    ax = tl.abs(g)
    exponent = _mxfp4_scale_byte(tl.max(ax, 2))[:, :, None]  # the scale 2^(exponent - 127)
    k = _e2m1_magnitude(ax * ((254 - exponent) << 23).to(tl.float32, bitcast=True))  # of |x| / scale (exact)
    mag = tl.where(k < 4, k.to(tl.float32) * 0.5,
                   tl.where(k == 4, 2.0, tl.where(k == 5, 3.0, tl.where(k == 6, 4.0, 6.0))))
    q = mag * (exponent << 23).to(tl.float32, bitcast=True)  # exact: at most 2 significant bits
    # x's sign bit (-0.0 for negatives that round to 0); the value is exact in bf16
    q = (q.to(tl.int32, bitcast=True) | ((g.to(tl.int32, bitcast=True) >> 31) << 31)).to(tl.float32, bitcast=True)
    tl.store(at, _f32_to_bf16(tl.reshape(q, (HEADS, DP))), mask=live)


def rope_fp4_qdq_triton_(x, rot):
    """Rotates and quantize-dequantizes x (contiguous) in place, as the reference."""
    pairs = rot.shape[-2]
    heads = x.shape[-2] if x.dim() == rot.dim() else 1  # [..., T, heads, D] or [..., T, D]
    tokens = rot.numel() // (2 * pairs)
    if tokens:
        dp = triton.next_power_of_2(x.shape[-1])
        block = min(max(1, VALUES_PER_PROGRAM // dp), triton.next_power_of_2(heads))
        _rope_fp4_qdq_kernel[(tokens, triton.cdiv(heads, block))](
            x, rot.contiguous(), heads, x.shape[-1], HEADS=block, DP=dp, PAIRS=pairs, num_warps=4,
            **launch_options(x.device))
