"""The release's quantize-dequantize points (MODEL.md section 6), as plain differentiable-free torch.

These reproduce the reference kernels' arithmetic bit for bit on CPU: the power-of-two scale is
2^ceil(log2(amax * fp32(1/max))) read off the float's exponent bits (not log2, whose rounding differs),
E4M3 rounding is round-to-nearest-even after clamping to +-448, and E2M1 rounding is round-half-even.
All functions take bf16 (or fp32) input and return the dequantized values in the input dtype.
"""

import torch

from .formats import round_to_e2m1

FP8_MAX = 448.0
FP4_MAX = 6.0
# The reference kernels multiply by the reciprocal held as an fp32 constant, so we do too.
_FP8_MAX_INV = 1.0 / FP8_MAX
_FP4_MAX_INV = 1.0 / FP4_MAX


def pow2_ceil_scale(amax: torch.Tensor, max_inv: float) -> torch.Tensor:
    """2^ceil(log2(amax * max_inv)) in fp32, from the exponent and mantissa bits of the product."""
    x = (amax.float() * max_inv).contiguous()
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa_nonzero = (bits & 0x7FFFFF) != 0
    return ((exponent + mantissa_nonzero.to(torch.int32)) << 23).view(torch.float32)


def _groups(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the quantization block {block}")
    return x.float().unflatten(-1, (-1, block))


def fp8_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation FP8: E4M3 codes [..., n] and fp32 power-of-two scales [..., n / block]."""
    g = _groups(x, block)
    scale = pow2_ceil_scale(g.abs().amax(-1).clamp_min(1e-4), _FP8_MAX_INV)
    codes = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.flatten(-2), scale


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 quantize-dequantize in groups of `block` (activations before FP8 GEMMs, window KV)."""
    codes, scale = fp8_quantize(x, block)
    return (codes.float().unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


def fp4_qdq_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E2M1 with power-of-two scales in groups of `block` (indexer queries and keys)."""
    g = _groups(x, block)
    scale = pow2_ceil_scale(g.abs().amax(-1).clamp_min(6 * 2.0**-126), _FP4_MAX_INV).unsqueeze(-1)
    return (round_to_e2m1((g / scale).clamp(-FP4_MAX, FP4_MAX)) * scale).flatten(-2).to(x.dtype)


def fp4_qdq_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """E2M1 with E4M3 scales e4m3(amax / 6) in groups of `block` (compressed KV, NVFP4 layout)."""
    g = _groups(x, block)
    amax = g.abs().amax(-1).clamp_min(6 * 2.0**-9)
    scale = (amax / FP4_MAX).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().unsqueeze(-1)
    return (round_to_e2m1((g / scale).clamp(-FP4_MAX, FP4_MAX)) * scale).flatten(-2).to(x.dtype)
