"""`dsflash::fp8_block_linear`: a projection whose weight stays in the release's FP8 format.

    weight e4m3 [N, K] with one UE8M0 scale per 32x32 tile ([ceil(N/32), ceil(K/32)], formats.py)
    out[..., n] = sum_k x[..., k] * weight[n, k] * scale[n // 32, k // 32]           (groups = 1)

With groups = G > 1 the projection is block-diagonal, as the attention's grouped output projection `wo_a`:
x [..., G * K] is G groups of K inputs and group g's N / G outputs read only group g's inputs.

The reference dequantizes the weight (exact in bf16) and multiplies as the bf16 model does
(`layers.block_diagonal_linear`, QuantLinear's product), so on CPU a model holding FP8 weights gives the bf16 model's bits. On CUDA
the Triton kernel (fp8_linear_triton.py) dequantizes tiles in registers (decode: a few rows, bound by the
weight's bytes); prefill-sized inputs and shapes it does not take run the reference (the weight dequantized
once, then cuBLAS).
"""

import torch
from torch import Tensor

from dsflash_compile import formats
from dsflash_compile.layers import block_diagonal_linear, check_block_diagonal


@torch.library.custom_op("dsflash::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: Tensor, weight: Tensor, scale: Tensor, groups: int = 1) -> Tensor:
    """x bf16 [..., groups * K]; weight float8_e4m3fn [N, K]; scale float8_e8m0fnu [ceil(N/32), ceil(K/32)].
    Returns bf16 [..., N]."""
    return fp8_block_linear_reference(x, weight, scale, groups)


def check_inputs(x: Tensor, weight: Tensor, groups: int) -> None:
    """Errors that name the problem (formats.py checks the weight's dtype and its scale's shape)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"fp8_block_linear: activations must be bf16, got {x.dtype}")
    check_block_diagonal("fp8_block_linear", x, weight, groups)


def fp8_block_linear_reference(x, weight, scale, groups=1):
    """Dequantize (exact), then the bf16 model's own product."""
    check_inputs(x, weight, groups)
    return block_diagonal_linear(x, formats.dequant_fp8_block(weight, scale, x.dtype), groups)


@fp8_block_linear.register_fake
def _(x, weight, scale, groups=1):
    check_inputs(x, weight, groups)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


try:  # Triton is optional on CPU machines
    from . import fp8_linear_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    fp8_linear_triton = None

if fp8_linear_triton is not None:
    @fp8_block_linear.register_kernel("cuda")
    def _(x, weight, scale, groups=1):
        if not fp8_linear_triton.kernel_fits(x, weight, scale, groups):
            return fp8_block_linear_reference(x, weight, scale, groups)
        return fp8_linear_triton.fp8_block_linear_triton(x, weight, scale, groups)
