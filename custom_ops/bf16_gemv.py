"""`dsflash::bf16_gemv`: `dsflash::bf16_linear` (bf16_linear.py: the math, the input checks, the reference) for
one row, on a kernel that loads each program's weight tile at once (bf16_linear_gemv_triton.py).

Its own op so that a compiled model chooses it per projection (QuantLinear.gemv, set by compile() from
CompileOptions.linear_gemv) and a run can set it beside bf16_linear side by side. On CUDA, weights the kernel
does not take (more than ~24 MB on the H200, outputs not in 16-wide blocks) run bf16_linear's kernel.
"""

import torch
from torch import Tensor

from .bf16_linear import bf16_linear, bf16_linear_reference, check_inputs


def check_one_row(x: Tensor, weight: Tensor, groups: int, quantize_x: bool) -> None:
    check_inputs(x, weight, groups, quantize_x)
    if x.numel() != x.shape[-1]:
        raise ValueError(f"bf16_gemv: one row only, got x of shape {tuple(x.shape)} (use dsflash::bf16_linear)")


@torch.library.custom_op("dsflash::bf16_gemv", mutates_args=())
def bf16_gemv(x: Tensor, weight: Tensor, groups: int, quantize_x: bool) -> Tensor:
    """x bf16 [..., groups * K] holding one row; weight bf16 [N, K]. Returns bf16 [..., N]."""
    check_one_row(x, weight, groups, quantize_x)
    return bf16_linear_reference(x, weight, groups, quantize_x)


@bf16_gemv.register_fake
def _(x, weight, groups, quantize_x):
    check_one_row(x, weight, groups, quantize_x)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


try:  # Triton is optional on CPU machines
    from . import bf16_linear_gemv_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    bf16_linear_gemv_triton = None

if bf16_linear_gemv_triton is not None:
    @bf16_gemv.register_kernel("cuda")
    def _(x, weight, groups, quantize_x):
        check_one_row(x, weight, groups, quantize_x)
        if bf16_linear_gemv_triton.fits(x, weight, groups):
            return bf16_linear_gemv_triton.bf16_linear_gemv(x, weight, groups, quantize_x)
        return bf16_linear(x, weight, groups, quantize_x)
