"""Triton kernel of `dsflash::fp8_qdq` (see fp8_qdq.py): one program per GROUPS consecutive groups of 32 values
(x contiguous, so a group never straddles rows), rounded as quant.fp8_qdq (_fp8_qdq_groups,
fp32 arithmetic the interpreter runs as the GPU does; every kernel that FP8-rounds groups of 32 takes it)."""

import triton
import triton.language as tl

from .pdl import launch_options, pdl_wait


@triton.jit
def _fp8_qdq_groups(v, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp32 [ROWS, COLS] -> quant.fp8_qdq's values (fp32) over groups of 32 columns."""
    g = tl.reshape(v, (ROWS, COLS // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(g), 2), 1e-4)
    bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # 2^ceil(log2(amax / 448))
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # exact: scale is a power of two
    q = tl.minimum(tl.maximum(g * inverse[:, :, None], -448.0), 448.0)
    # E4M3: 3 mantissa bits from 2^-6 up, steps of 2^-9 below; x + 2^(e+20) keeps exactly those bits (RNE)
    a = tl.abs(q)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    big = ((e + 147) << 23).to(tl.float32, bitcast=True)
    r = (a + big) - big
    r = tl.where(q < 0, -r, r)
    return tl.reshape(r * scale[:, :, None], (ROWS, COLS))


GROUPS = 32  # 1024 values a program: B64's 64 x 5120 input is 320 programs, a 5120-value row 5


@triton.jit
def _fp8_qdq_kernel(x_ptr, out_ptr, n_groups, GROUPS: tl.constexpr, PDL: tl.constexpr):
    """x, out [n_groups * 32] contiguous."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    at = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    live = (g < n_groups)[:, None]
    x = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
    # E4M3 values times a power of two: exact in bf16
    tl.store(out_ptr + at, _fp8_qdq_groups(x, GROUPS, 32).to(tl.bfloat16), mask=live)


def fp8_qdq_triton(x):
    """bf16 [..., K] as the reference (contiguous)."""
    x = x.contiguous()
    out = x.new_empty(x.shape)
    n_groups = x.numel() // 32
    if n_groups:
        _fp8_qdq_kernel[(triton.cdiv(n_groups, GROUPS),)](x, out, n_groups, GROUPS=GROUPS, num_warps=4,
                                                         **launch_options(x.device))
    return out
