"""`dsflash::bf16_linear`: a bf16 projection of a few rows (decode), its input FP8-rounded in the same launch.

    x = fp8_qdq(x) in groups of 32                          (quantize_x: as QuantLinear does before its GEMM)
    out[..., n] = bf16(sum_k x[..., k] * weight[n, k])      (fp32 products and sum)            groups = 1
    groups = G > 1: block-diagonal (the attention's `wo_a`): group g's N / G outputs read only its K inputs
    rot given: out as [..., N / head_dim, head_dim], each head's trailing pairs rotated by rot (rope.apply_rope;
    the attention's query: wq_b then its RoPE, joined by passes/linear_rope.py)

Why an op: at decode batch 1 a bf16 layer's four projections (wq_a+wkv, wq_b, wo_a, wo_b: 253 MB) ran as
cuBLAS GEMVs at 3.3-3.7 TB/s, two of them with a split-K reduce kernel after them, and two behind an Inductor
FP8 kernel of their input (H200 trace, 12-01 k: 75.5 us of GEMMs and 6 us of reduce/FP8 kernels a layer, the
weights' bytes take 57.6 us at the lm_head's 4.5 TB/s). The Triton kernel (bf16_linear_triton.py) streams the
weight over every SM, quantizes its x tiles as it loads them and finishes split-K inside the launch. For one
row, `dsflash::bf16_gemv` (bf16_gemv.py) is the same math on a kernel for weights of up to ~24 MB (wq_a+wkv), and
one row of a large projection (wq_b, wo_a, wo_b) runs bf16_linear_tma_triton.py's kernel (weight tiles by TMA).

The reference is QuantLinear's own math (CPU, and on CUDA for shapes the kernel does not take).
"""

from typing import Optional

import torch
from torch import Tensor

from dsflash_compile.layers import block_diagonal_linear, check_block_diagonal
from dsflash_compile.quant import fp8_qdq
from dsflash_compile.rope import apply_rope

MAX_ROWS = 64  # the kernel's largest row tile (more would spill on sm_90); above, the reference (cuBLAS)
# 33-64 rows (decode batch 64) of the long-K projections (groups x K >= TALL_MIN_K: wo_a, wo_b), their input FP8-rounded
# before the op (each output block would round the whole row tile again): H200, 64 rows (sweep_linear.py --rows 64
# --grid tall --prequantized, 12-02 q): wo_a 23.0 us against cuBLAS's 24.5, wo_b 28.7 against 29.3 (cuBLAS splits K
# and reduces in a second kernel); wq_b (K 1280) 24.7 against 24.4 and wq_a+wkv 10.8 against 8.3 stay on cuBLAS
TALL_MIN_ROWS = 33
TALL_MIN_K = 8192


@torch.library.custom_op("dsflash::bf16_linear", mutates_args=())
def bf16_linear(x: Tensor, weight: Tensor, groups: int, quantize_x: bool, rot: Optional[Tensor] = None,
                head_dim: int = 0) -> Tensor:
    """x bf16 [..., groups * K]; weight bf16 [N, K]; rot fp32 [..., p, 2] (rope.rotation, x's leading dims) or
    None. Returns bf16 [..., N]."""
    return bf16_linear_reference(x, weight, groups, quantize_x, rot, head_dim)


def check_rope(x: Tensor, weight: Tensor, groups: int, rot: Optional[Tensor], head_dim: int) -> None:
    """The RoPE epilogue's arguments, as errors that name the problem."""
    if rot is None:
        return
    if rot.dtype != torch.float32 or rot.device != x.device:
        raise TypeError(f"bf16_linear: rot must be fp32 on x's device, got {rot.dtype} on {rot.device}")
    if groups != 1 or head_dim < 2 or weight.shape[0] % head_dim:
        raise ValueError(f"bf16_linear: the RoPE epilogue needs groups=1 and head_dim dividing the {weight.shape[0]} "
                         f"outputs, got groups={groups}, head_dim={head_dim}")
    if (tuple(rot.shape[:-2]) != tuple(x.shape[:-1]) or rot.shape[-1] != 2 or rot.shape[-2] < 1
            or 2 * rot.shape[-2] > head_dim):
        raise ValueError(f"bf16_linear: rot has shape {tuple(rot.shape)}; expected {tuple(x.shape[:-1])} + "
                         f"(pairs, 2) with 1 <= pairs and 2 * pairs <= head_dim = {head_dim}")


def check_inputs(x: Tensor, weight: Tensor, groups: int, quantize_x: bool) -> None:
    """Errors that name the problem."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise TypeError(f"bf16_linear: x and weight must be bf16, got {x.dtype} and {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"bf16_linear: weight must be [N, K], got {tuple(weight.shape)}")
    check_block_diagonal("bf16_linear", x, weight, groups)
    if quantize_x and x.shape[-1] % 32:
        raise ValueError(f"bf16_linear: quantize_x needs the inputs ({x.shape[-1]}) to be a multiple of the FP8 "
                         "group (32)")


def bf16_linear_reference(x, weight, groups, quantize_x, rot=None, head_dim=0):
    check_inputs(x, weight, groups, quantize_x)
    check_rope(x, weight, groups, rot, head_dim)
    out = block_diagonal_linear(fp8_qdq(x) if quantize_x else x, weight, groups)
    if rot is None:
        return out
    return apply_rope(out.unflatten(-1, (-1, head_dim)), rot).flatten(-2)


@bf16_linear.register_fake
def _(x, weight, groups, quantize_x, rot=None, head_dim=0):
    check_inputs(x, weight, groups, quantize_x)
    check_rope(x, weight, groups, rot, head_dim)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


try:  # Triton is optional on CPU machines
    from . import bf16_linear_tma_triton, bf16_linear_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    bf16_linear_triton = None

if bf16_linear_triton is not None:
    @bf16_linear.register_kernel("cuda")
    def _(x, weight, groups, quantize_x, rot=None, head_dim=0):
        check_inputs(x, weight, groups, quantize_x)
        check_rope(x, weight, groups, rot, head_dim)
        if not bf16_linear_triton.kernel_fits(x, weight, groups):
            return bf16_linear_reference(x, weight, groups, quantize_x, rot, head_dim)
        if bf16_linear_tma_triton.takes(x, weight, groups):  # one row of wq_b (its RoPE in the epilogue), wo_a, wo_b
            return bf16_linear_tma_triton.bf16_linear_tma(x, weight, groups, quantize_x, rot, head_dim)
        return bf16_linear_triton.bf16_linear_triton(x, weight, groups, quantize_x, rot=rot, head_dim=head_dim)
