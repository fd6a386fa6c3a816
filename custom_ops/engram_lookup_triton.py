"""Triton kernel of `dsflash::engram_lookup` (engram_lookup.py): one program per looked-up row.

The codes and scales are read as bytes and decoded from their bits (no fp8 casts: the interpreter's are not the
GPU's, and Inductor has no code for UE8M0): E4M3 normal codes become the fp32 with their sign, exponent (rebiased
7 -> 127) and 3 mantissa bits, subnormal ones k * 2^-9, 0x7F / 0xFF NaN; a UE8M0 byte b the fp32 2^(b - 127)
(exponent field b; b = 0 the subnormal 2^-127, 255 NaN). Their product is exact in fp32, and rounds to bf16 in
integer arithmetic (exact for every normal product: at most 4 significant bits).
"""

import torch
import triton
import triton.language as tl

from .bf16_bits import _f32_to_bf16
from .pdl import launch_options, pdl_wait


@triton.jit
def _e4m3_values(code):
    """E4M3 bytes (int32 0..255) -> fp32 values."""
    sign = (code & 0x80) << 24
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = ((mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign).to(tl.float32,
                                                                                               bitcast=True)
    value = tl.where(exponent == 0, subnormal, normal)  # (k * 2^-9 with the code's sign, -0 kept)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _ue8m0_values(byte):
    """UE8M0 bytes (int32 0..255) -> fp32 2^(byte - 127)."""
    value = tl.where(byte == 0, 1 << 22, byte << 23).to(tl.float32, bitcast=True)
    return tl.where(byte == 255, float("nan"), value)


@triton.jit
def _engram_lookup_kernel(weight_ptr, scale_ptr, ids_ptr, out_ptr, D: tl.constexpr, PDL: tl.constexpr):
    """weight bytes [rows, D], scale bytes [rows, D / 32], ids [N], out bf16 [N, D]."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    pid = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + pid).to(tl.int64)
    g = tl.arange(0, D // 32)
    d = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    codes = tl.load(weight_ptr + row * D + d).to(tl.int32)
    scales = _ue8m0_values(tl.load(scale_ptr + row * (D // 32) + g).to(tl.int32))
    tl.store(out_ptr + pid * D + d, _f32_to_bf16(_e4m3_values(codes) * scales[:, None]))


def engram_lookup_triton(weight, scale, ids):
    """bf16 [*ids.shape, d] as the reference (inputs checked by the op; d a power of two)."""
    dim = weight.shape[1]
    out = torch.empty(*ids.shape, dim, dtype=torch.bfloat16, device=weight.device)
    flat = ids.reshape(-1)
    if flat.numel():
        _engram_lookup_kernel[(flat.numel(),)](weight.view(torch.uint8), scale.view(torch.uint8), flat.contiguous(),
                                               out, D=dim, num_warps=1 if dim <= 256 else 2,
                                               **launch_options(weight.device))
    return out
