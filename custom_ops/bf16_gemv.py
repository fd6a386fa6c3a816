"""`dsflash::bf16_gemv`: `dsflash::bf16_linear` (bf16_linear.py: the math, the input checks, the reference) for
one row, on a kernel that loads each program's weight tile at once (bf16_linear_gemv_triton.py).

Its own op so that a compiled model chooses it per projection (QuantLinear.gemv, set by compile() from
CompileOptions.linear_gemv) and a run can set it beside bf16_linear side by side. On CUDA, weights the kernel
does not take (more than ~24 MB on the H200, outputs not in 16-wide blocks) run bf16_linear's kernel; with a norm,
one row of a projection bf16_linear's TMA kernel takes (wq_b) runs it with the norm in its prologue.
"""

from typing import Optional

import torch
from torch import Tensor

from .bf16_linear import bf16_linear, bf16_linear_reference, check_inputs, check_rope
from .mhc import rms_norm


def check_one_row(x: Tensor, weight: Tensor, groups: int, quantize_x: bool,
                  norm_weight: Optional[Tensor] = None) -> None:
    check_inputs(x, weight, groups, quantize_x)
    if x.numel() != x.shape[-1]:
        raise ValueError(f"bf16_gemv: one row only, got x of shape {tuple(x.shape)} (use dsflash::bf16_linear)")
    if norm_weight is not None and (groups != 1 or norm_weight.dtype != torch.bfloat16
                                    or tuple(norm_weight.shape) != (x.shape[-1],)):
        raise ValueError(f"bf16_gemv: norm_weight must be bf16 ({x.shape[-1]},) with groups=1, got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)}, groups={groups}")


def gemv_reference(x, weight, groups, quantize_x, rot=None, head_dim=0, norm_weight=None, norm_eps=0.0, out_scale=1.0):
    """The op's math: x RMS-normed first where norm_weight is given (layers.RMSNorm), then bf16_linear's, then times
    out_scale (a bf16 product: rounded again)."""
    x = x if norm_weight is None else rms_norm(x, norm_weight, norm_eps)
    out = bf16_linear_reference(x, weight, groups, quantize_x, rot, head_dim)
    return out if out_scale == 1.0 else out * out_scale


@torch.library.custom_op("dsflash::bf16_gemv", mutates_args=())
def bf16_gemv(x: Tensor, weight: Tensor, groups: int, quantize_x: bool, rot: Optional[Tensor] = None,
              head_dim: int = 0, norm_weight: Optional[Tensor] = None, norm_eps: float = 0.0,
              after: Optional[Tensor] = None, early: bool = False, out_scale: float = 1.0) -> Tensor:
    """x bf16 [..., groups * K] holding one row; weight bf16 [N, K]; rot, head_dim: bf16_linear's RoPE of the
    output's heads (passes/linear_rope.py); norm_weight bf16 [K], norm_eps: x's RMSNorm first (the mHC seam's,
    passes/seam_norm_gemv.py; the query's, passes/linear_norm.py). after (never read) and early: set by
    passes/early_reads.py, after a tensor a kernel computed from x's producer (so that kernel runs between them and
    this op); early, the whole-tile kernel reads x and its weight before its PDL wait (bf16_linear_gemv_triton.py).
    out_scale: the output times it, rounded to bf16 again (passes/linear_scale.py: a constant multiply of the output
    folded in). Returns bf16 [..., N]."""
    check_one_row(x, weight, groups, quantize_x, norm_weight)
    return gemv_reference(x, weight, groups, quantize_x, rot, head_dim, norm_weight, norm_eps, out_scale)


@bf16_gemv.register_fake
def _(x, weight, groups, quantize_x, rot=None, head_dim=0, norm_weight=None, norm_eps=0.0, after=None, early=False,
      out_scale=1.0):
    check_one_row(x, weight, groups, quantize_x, norm_weight)
    check_rope(x, weight, groups, rot, head_dim)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


try:  # Triton is optional on CPU machines
    from . import bf16_linear_gemv_triton, bf16_linear_tma_triton, rope_tail_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    bf16_linear_gemv_triton = None

if bf16_linear_gemv_triton is not None:
    @bf16_gemv.register_kernel("cuda")
    def _(x, weight, groups, quantize_x, rot=None, head_dim=0, norm_weight=None, norm_eps=0.0, after=None,
          early=False, out_scale=1.0):
        check_one_row(x, weight, groups, quantize_x, norm_weight)
        check_rope(x, weight, groups, rot, head_dim)
        (n, k), fits = weight.shape, bf16_linear_gemv_triton.fits(x, weight, groups)
        if (norm_weight is not None and not fits and bf16_linear_tma_triton.takes(x, weight, groups)
                and bf16_linear_tma_triton.takes_norm(k, groups)):  # (wq_b)
            return _scaled(bf16_linear_tma_triton.bf16_linear_tma(x, weight, groups, quantize_x, rot, head_dim,
                                                                  norm_weight, norm_eps), out_scale)
        if norm_weight is not None and not (fits and bf16_linear_gemv_triton.takes_norm(
                n, k, groups, bf16_linear_gemv_triton._num_sms(x.device))):
            # the norm apart, where no kernel takes it; its kernels then write x just before: no early reads
            x, norm_weight, early = rms_norm(x, norm_weight, norm_eps), None, False
        if not fits:  # (wq_b: bf16_linear's kernel, RoPE in its epilogue; it waits before its reads)
            return _scaled(bf16_linear(x, weight, groups, quantize_x, rot, head_dim), out_scale)
        out = bf16_linear_gemv_triton.bf16_linear_gemv(x, weight, groups, quantize_x, norm_weight=norm_weight,
                                                       eps=norm_eps, early=early,
                                                       out_scale=out_scale if rot is None else 1.0)
        if rot is not None:  # a weight this kernel takes: the RoPE's own kernel after it, then the scale
            rope_tail_triton.rope_tail_triton_(out.unflatten(-1, (-1, head_dim)), rot)
            out = _scaled(out, out_scale)
        return out

    def _scaled(out, out_scale):
        """The output times out_scale where no kernel's epilogue took it (a bf16 multiply: the reference's)."""
        return out if out_scale == 1.0 else out * out_scale
