"""bf16 from and to fp32 in integer arithmetic on the bits, for Triton kernels: the interpreter's casts are not the
GPU's (its fp32 -> bf16 cast truncates, its bf16 -> fp32 cast turns subnormals into other values), so kernels that
must equal a PyTorch reference bit for bit on both round with these.

NaN stays NaN: the GPU's NaN results are 0x7FFFFFFF (0xFFFFFFFF negated), whose rounding increment would carry
into the sign bit and leave -0 (+0): a NaN silently lost (12-05: engram_lookup's CUDA test, where a code or scale
is NaN; the interpreter's NaN, 0x7FC00000, hid it). A NaN whose payload lies in the low 16 bits only would
truncate to inf: NaNs are made quiet (the bit bf16 keeps) instead."""

import triton
import triton.language as tl


@triton.jit
def _round_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), in fp32; on the GPU the same values as the cast."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(v == v, rounded, (bits | 0x400000).to(tl.float32, bitcast=True))  # a quiet NaN, kept in bf16


@triton.jit
def _bf16_as_f32(v):
    """bf16 -> fp32 from the bits (exact)."""
    return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(v):
    """fp32 -> bf16, to nearest (ties to even), as the GPU's cast."""
    return (_round_bf16(v).to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
