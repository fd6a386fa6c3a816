"""`dsflash::fp32_gemv`: one row of an fp32 projection, F.linear(x.float(), weight) with fp32 sums and output.

The ratio > 1 compressors project in fp32 (the release pools in fp32): wkv and wgate, 2 x 8 MB at flash's sizes,
fused into one [1024, 4096] weight at compile time (Compressor.fuse_projections). On the H200's B1 step cuBLAS ran
them as two fp32 GEMVs of 6.4 us (1.3 TB/s) after an Inductor kernel widening x (12-04 d5 trace, in each of the
three ratio-2 sources). On CUDA the op runs bf16_gemv's kernel (bf16_linear_gemv_triton.py), which widens a bf16
x as it loads it, sums in fp32 and stores the sums unrounded for an fp32 weight: the products are exact in fp32,
the sums within fp32 rounding of the reference's (another order). CPU: the reference.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def check_inputs(x: Tensor, weight: Tensor) -> None:
    """Errors that name the problem."""
    if weight.dtype != torch.float32 or x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"fp32_gemv: weight must be fp32 and x bf16 or fp32, got {weight.dtype} and {x.dtype}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp32_gemv: x {tuple(x.shape)} must end in weight {tuple(weight.shape)}'s K")
    if x.numel() != x.shape[-1]:
        raise ValueError(f"fp32_gemv: one row only, got x of shape {tuple(x.shape)}")


def fp32_gemv_reference(x: Tensor, weight: Tensor) -> Tensor:
    check_inputs(x, weight)
    return F.linear(x.float(), weight)


@torch.library.custom_op("dsflash::fp32_gemv", mutates_args=())
def fp32_gemv(x: Tensor, weight: Tensor, after: Optional[Tensor] = None, early: bool = False) -> Tensor:
    """x bf16 or fp32 [..., K] holding one row; weight fp32 [N, K]; after, early: dsflash::bf16_gemv's (its reads
    before the PDL wait, set by passes/early_reads.py). Returns fp32 [..., N]."""
    return fp32_gemv_reference(x, weight)


@fp32_gemv.register_fake
def _(x, weight, after=None, early=False):
    check_inputs(x, weight)
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


try:  # Triton is optional on CPU machines
    from . import bf16_linear_gemv_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    bf16_linear_gemv_triton = None

if bf16_linear_gemv_triton is not None:
    @fp32_gemv.register_kernel("cuda")
    def _(x, weight, after=None, early=False):
        check_inputs(x, weight)
        if not bf16_linear_gemv_triton.fits(x, weight, 1):  # (outputs not in 16-wide blocks, too large a weight)
            return fp32_gemv_reference(x, weight)
        return bf16_linear_gemv_triton.bf16_linear_gemv(x, weight, 1, False, early=early)
