"""`dsflash::grouped_swiglu`: the first half of MoE's sorted path (bf16 experts) as one op.

    pairs sorted by expert: order [P] (pair p = token order[p] // k, slot order[p] % k); offsets [G] cumulative
    xs = x[order // k]                                           (x already FP8-rounded where the experts want it)
    gate, up = bf16(xs @ W1[e]^T), bf16(xs @ W3[e]^T)            (e: the row's expert by offsets; 0 past the last)
    gate, up = min(gate, limit), clamp(up, -limit, limit)        (limit > 0 only)
    h = bf16(weights.flatten()[order] * (silu(gate) * up)), then FP8 quantize-dequantized in groups of 32
                                                                 (quantize_h: the down projection's input)

Why an op: in the compiled decode step (batch 17-64) MoE ran this as a gather of x's rows, two grouped GEMMs
(w1 and w3, each streaming its experts' weights), and an Inductor kernel for the clamps, SwiGLU, weight and FP8
of h (H200 B64 trace, 12-02 p: 2.8 + 58 + 58 + 4.9-8.8 us a layer, four launches and their gaps). On CUDA this
op is one launch (grouped_swiglu_triton.py): each program reads its rows of x through `order`, streams its
expert's W1 and W3 slices side by side and writes h ready for the down projection.

The reference is MoE's own math (the grouped GEMMs' reference per expert), for CPU and inputs the kernel does not
take.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from dsflash_compile.quant import fp8_qdq

from .mxfp4_experts import grouped_mm_reference


@torch.library.custom_op("dsflash::grouped_swiglu", mutates_args=())
def grouped_swiglu(x: Tensor, weights: Tensor, order: Tensor, w1: Tensor, w3: Tensor, offsets: Tensor, limit: float,
                   quantize_h: bool) -> Tensor:
    """x bf16 [T, D]; weights fp32 [T, k]; order int64 [T k] (the pairs sorted by expert); w1, w3 bf16 [G, I, D];
    offsets int32 [G]. Returns h bf16 [T k, I] in the sorted order (rows past offsets[-1] zero)."""
    return grouped_swiglu_reference(x, weights, order, w1, w3, offsets, limit, quantize_h)


def check_inputs(x, weights, order, w1, w3, offsets, quantize_h) -> None:
    if x.dim() != 2 or weights.dim() != 2 or weights.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_swiglu: x [T, D] and weights [T, k] expected, got {tuple(x.shape)} and "
                         f"{tuple(weights.shape)}")
    if order.dtype != torch.int64 or tuple(order.shape) != (weights.numel(),):
        raise ValueError(f"grouped_swiglu: order must be int64 [{weights.numel()}] (one entry per pair), got "
                         f"{order.dtype} {tuple(order.shape)}")
    if weights.dtype != torch.float32 or x.dtype != torch.bfloat16:
        raise TypeError(f"grouped_swiglu: x must be bf16 and weights fp32, got {x.dtype} and {weights.dtype}")
    if w1.dtype != torch.bfloat16 or w1.dim() != 3 or w1.shape != w3.shape or w1.dtype != w3.dtype:
        raise ValueError(f"grouped_swiglu: w1 and w3 must be bf16 [G, I, D] alike, got {w1.dtype} {tuple(w1.shape)} "
                         f"and {w3.dtype} {tuple(w3.shape)}")
    if w1.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_swiglu: x {tuple(x.shape)} and w1 {tuple(w1.shape)} differ in D")
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (w1.shape[0],):
        raise ValueError(f"grouped_swiglu: offsets must be int32 [{w1.shape[0]}] (one per stacked expert), got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    if quantize_h and w1.shape[1] % 32:
        raise ValueError(f"grouped_swiglu: quantize_h needs the intermediate size ({w1.shape[1]}) to be a multiple "
                         "of the FP8 group (32)")


def grouped_swiglu_reference(x, weights, order, w1, w3, offsets, limit, quantize_h):
    check_inputs(x, weights, order, w1, w3, offsets, quantize_h)
    xs = x[order // weights.shape[1]]
    gate = grouped_mm_reference(xs, w1, offsets).float()
    up = grouped_mm_reference(xs, w3, offsets).float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    h = (weights.flatten()[order].unsqueeze(1) * (F.silu(gate) * up)).to(x.dtype)
    return fp8_qdq(h) if quantize_h else h


@grouped_swiglu.register_fake
def _(x, weights, order, w1, w3, offsets, limit, quantize_h):
    check_inputs(x, weights, order, w1, w3, offsets, quantize_h)
    return x.new_empty(order.shape[0], w1.shape[1])


try:  # Triton is optional on CPU machines
    from . import grouped_swiglu_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    grouped_swiglu_triton = None

if grouped_swiglu_triton is not None:
    @grouped_swiglu.register_kernel("cuda")
    def _(x, weights, order, w1, w3, offsets, limit, quantize_h):
        check_inputs(x, weights, order, w1, w3, offsets, quantize_h)
        return grouped_swiglu_triton.grouped_swiglu_triton(x, weights, order, w1, w3, offsets, limit, quantize_h)
