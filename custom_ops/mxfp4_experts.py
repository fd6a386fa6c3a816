"""`dsflash::mxfp4_grouped_mm`: the routed experts' grouped GEMM with their weights kept in MXFP4.

    weight int8 [E, N, K/2] (packed E2M1, element 2k in the low nibble), scale UE8M0 [E, N, K/32]
    rows [offsets[e-1], offsets[e]) of x (offsets[-1] = 0) are multiplied by expert e's weight:
    out[r, n] = sum_k x[r, k] * e2m1(weight[e, n, k]) * scale[e, n, k // 32]

The same contract as `torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)` over bf16 stacked weights
(moe.py's grouped path), with rows sorted by expert; rows past offsets[-1] are zero. Only experts that
have rows are read: the reference dequantizes just those (one host sync for the list, the reference
being the CPU path) and multiplies each as the bf16 model's expert loop does (F.linear over the same
rows), so on CPU a model holding MXFP4 experts gives the bf16 model's bits. On CUDA the Triton kernel
(mxfp4_experts_triton.py) needs no host sync and dequantizes in registers.

`dsflash::grouped_mm` is the same contract over bf16 stacked weights [E, N, K], for the decode step of a
bf16 model (moe.py uses it up to MoE.few_rows rows): the same Triton kernel, which streams each selected
expert's weight once over many programs, where torch._grouped_mm's grouped GEMM reaches about half the
copy bandwidth at a few rows per expert. Its reference is the same per-expert F.linear.
`dsflash::grouped_mm_by_rows` makes moe.py's choice between it and torch._grouped_mm when it runs (a graph
with a symbolic row count, dynamic shapes, is then not guarded on it, which would give one graph per side).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from dsflash_compile import formats


@torch.library.custom_op("dsflash::mxfp4_grouped_mm", mutates_args=())
def mxfp4_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, offsets: Tensor) -> Tensor:
    """x bf16 [P, K]; weight int8 [E, N, K/2]; scale float8_e8m0fnu [E, N, K/32]; offsets int32 [E]
    (cumulative row counts). Returns bf16 [P, N]."""
    return mxfp4_grouped_mm_reference(x, weight, scale, offsets)


def check_inputs(x: Tensor, weight: Tensor, scale: Tensor, offsets: Tensor) -> None:
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError(f"mxfp4_grouped_mm: x must be bf16 [rows, K], got {x.dtype} {tuple(x.shape)}")
    if weight.dim() != 3 or weight.dtype != torch.int8 or scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"mxfp4_grouped_mm: weight must be int8 [E, N, K/2] and scale float8_e8m0fnu, got "
                        f"{weight.dtype} {tuple(weight.shape)} and {scale.dtype}")
    experts, n, half = weight.shape
    if x.shape[1] != 2 * half or tuple(scale.shape) != (experts, n, -(-2 * half // formats.BLOCK)):
        raise ValueError(f"mxfp4_grouped_mm: x {tuple(x.shape)}, weight {tuple(weight.shape)} and scale "
                         f"{tuple(scale.shape)} do not fit (K = 2 x packed columns, one scale per 32 inputs)")
    if tuple(offsets.shape) != (experts,) or offsets.dtype != torch.int32:
        raise ValueError(f"mxfp4_grouped_mm: offsets must be int32 [{experts}], got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")


def mxfp4_grouped_mm_reference(x, weight, scale, offsets):
    """Per expert with rows: dequantize (exact in bf16), then the bf16 expert's F.linear."""
    check_inputs(x, weight, scale, offsets)
    return per_expert(x, weight.shape[1], offsets, lambda e: formats.dequant_mxfp4(weight[e], scale[e], x.dtype))


def per_expert(x, n, offsets, expert_weight):
    """Each expert's rows of x (offsets: cumulative counts) through F.linear with expert_weight(e) [n, K]."""
    out = x.new_zeros(x.shape[0], n)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], expert_weight(e))
        start = end
    return out


@mxfp4_grouped_mm.register_fake
def _(x, weight, scale, offsets):
    check_inputs(x, weight, scale, offsets)
    return x.new_empty(x.shape[0], weight.shape[1])


try:  # Triton is optional on CPU machines
    from . import mxfp4_experts_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    mxfp4_experts_triton = None

if mxfp4_experts_triton is not None:
    @mxfp4_grouped_mm.register_kernel("cuda")
    def _(x, weight, scale, offsets):
        check_inputs(x, weight, scale, offsets)
        return mxfp4_experts_triton.grouped_mm_triton(x, weight, scale, offsets)


@torch.library.custom_op("dsflash::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """x bf16 [P, K] sorted by expert; weight bf16 [E, N, K]; offsets int32 [E] (cumulative row counts).
    Returns bf16 [P, N]: torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets), rows past offsets[-1]
    zero."""
    return grouped_mm_reference(x, weight, offsets)


def check_bf16_inputs(x: Tensor, weight: Tensor, offsets: Tensor) -> None:
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2 or weight.dim() != 3:
        raise TypeError(f"grouped_mm: x must be bf16 [rows, K] and weight bf16 [E, N, K], got {x.dtype} "
                        f"{tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_mm: x {tuple(x.shape)} and weight {tuple(weight.shape)} differ in K")
    if tuple(offsets.shape) != (weight.shape[0],) or offsets.dtype != torch.int32:
        raise ValueError(f"grouped_mm: offsets must be int32 [{weight.shape[0]}], got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")


def grouped_mm_reference(x, weight, offsets):
    check_bf16_inputs(x, weight, offsets)
    return per_expert(x, weight.shape[1], offsets, lambda e: weight[e])


@grouped_mm.register_fake
def _(x, weight, offsets):
    check_bf16_inputs(x, weight, offsets)
    return x.new_empty(x.shape[0], weight.shape[1])


if mxfp4_experts_triton is not None:
    @grouped_mm.register_kernel("cuda")
    def _(x, weight, offsets):
        check_bf16_inputs(x, weight, offsets)
        return mxfp4_experts_triton.grouped_mm_triton(x, weight, None, offsets)


@torch.library.custom_op("dsflash::grouped_mm_by_rows", mutates_args=())
def grouped_mm_by_rows(x: Tensor, weight: Tensor, offsets: Tensor, few_rows: int) -> Tensor:
    """dsflash::grouped_mm up to `few_rows` rows of x, else torch._grouped_mm (rows past offsets[-1] then
    undefined): MoE._grouped_mm's choice, made when the op runs. For graphs with a symbolic row count (dynamic
    shapes), where testing the count while tracing would guard the graph on it (one graph per side)."""
    if x.shape[0] <= few_rows:
        return torch.ops.dsflash.grouped_mm(x, weight, offsets)
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)


@grouped_mm_by_rows.register_fake
def _(x, weight, offsets, few_rows):
    check_bf16_inputs(x, weight, offsets)
    return x.new_empty(x.shape[0], weight.shape[1])
