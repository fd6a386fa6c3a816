"""`dsflash::mhc_seam` and `dsflash::mhc_entry_seam`: one mHC seam (MODEL.md section 2) as one op, for the
mHC fusion pass (passes/mhc_fusion.py).

A seam sits between two sublayers. With X the streams [..., hc, D] it receives:

    X'        = post(out, X, q, C)                  the previous sublayer's expansion (mhc_seam only)
    (p, q, C) = mixes(X'; fn, scale, base)          24-wide GEMV, sigmoids, Sinkhorn (this seam's mixes)
    normed    = rms_norm(pre(X', p_lagged); w)      the next sublayer's input (pre-mix of one seam earlier)

`mhc_seam` returns (X', normed, p, q, C). `mhc_entry_seam` is the same without the expansion, for streams
that do not come straight from a sublayer (block 0's embedding, the output of Engram): (normed, p, q, C).
The reference is the model's own mhc.py functions and RMSNorm (one definition of the math); the Triton
kernels (mhc_triton.py, and mhc_rows_triton.py for many tokens) are registered for CUDA.
"""

from types import SimpleNamespace

import torch
from torch import Tensor

from dsflash_compile.layers import RMSNorm
from dsflash_compile.mhc import hc_mixes, hc_post, hc_pre

# On CUDA, full seams of at least ROWS_MIN_TOKENS tokens run mhc_rows_triton.py's kernels, fewer the one-token
# kernel of mhc_triton.py (defined here, where machines without triton import it: CompileOptions checks it).
# H200 sweep (scripts/sweep_mhc.py --rows, 12-02 o, mhc-rows-sweep-2026-12-02-o.json; fn hot in L2): the rows
# kernels (main pass, then a finish per token) take 17.0 / 19.6 / 22.8 / 91 / 340 us at 32 / 64 / 128 / 1024 /
# 4096 tokens at their default launch, against the one-token kernel's 24.0 / 37.9 / 63.7 / 479 / 1894 us (and the
# one-launch rows kernel before them: 29.3 / 28.3 / 31.1 us at 32 / 64 / 128). 32 is the fewest tokens swept where
# the rows kernels win; the one-token kernel takes 16.5 us at 16, the overlap pass's largest seam
ROWS_MIN_TOKENS = 32
# The one-token seam kernel's columns of D per program up to 16 tokens (mhc_triton.py), and so the width of the
# chunks whose partials a deferred seam returns (mhc_deferred.py)
SEAM_BLOCK_D = 64
# the largest gate a routed seam routes in its finishing program (mhc_triton.py, mhc_deferred.py: one program holds
# [experts, 256] gate tiles): flash-40l-e8's 8 experts compile for sm_90 without spills, 16 spilled 1400 bytes
# (ptxas, 12-03 z); larger gates (the release's 384) keep dsflash::fused_router's grid
ROUTE_MAX_EXPERTS = 8


def partial_width(hc: int) -> int:
    """Floats in a row of the seam kernel's partials (one chunk of one token): the (2 + hc) hc mix dot products,
    the streams' and the collapse's sums of squares, zeros up to a power of 2."""
    return 1 << ((2 + hc) * hc + 1).bit_length()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The model's RMSNorm forward with a given weight (no module: the op receives the weight as a tensor)."""
    return RMSNorm.forward(SimpleNamespace(weight=weight, eps=eps), x)


def entry_seam_reference(streams, pre_lagged, fn, scale, base, norm_weight, norm_eps, hc_eps, iters):
    """(normed, pre, post, comb) of the streams as they are."""
    pre, post, comb = hc_mixes(streams, fn, scale, base, norm_eps, hc_eps, iters)
    return rms_norm(hc_pre(streams, pre_lagged), norm_weight, norm_eps), pre, post, comb


def seam_reference(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight, norm_eps, hc_eps, iters):
    """(new streams, normed, pre, post, comb): the previous sublayer's expansion, then the entry seam."""
    streams = hc_post(out, streams, post, comb)
    return (streams, *entry_seam_reference(streams, pre_lagged, fn, scale, base, norm_weight, norm_eps, hc_eps,
                                           iters))


def check_seam_args(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight) -> None:
    """Clear errors for shapes the seam cannot take (out/post/comb may be None: the entry seam; any other
    argument but the streams may be None where an op does not take it: the split ops of mhc_split.py)."""
    if streams.dim() < 3:
        raise ValueError(f"mhc seam: streams must be [..., hc, D], got shape {tuple(streams.shape)}")
    *lead, hc, dim = streams.shape
    lead = tuple(lead)
    expected = {"pre_lagged": (pre_lagged, lead + (hc,)), "fn": (fn, ((2 + hc) * hc, hc * dim)), "scale": (scale, (3,)),
                "base": (base, ((2 + hc) * hc,)), "norm_weight": (norm_weight, (dim,))}
    if out is not None:
        expected.update(out=(out, lead + (dim,)), post=(post, lead + (hc,)), comb=(comb, lead + (hc, hc)))
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"mhc seam: {name} has shape {tuple(tensor.shape)}; expected {shape} for streams "
                             f"{tuple(streams.shape)}")


@torch.library.custom_op("dsflash::mhc_seam", mutates_args=())
def mhc_seam(out: Tensor, streams: Tensor, post: Tensor, comb: Tensor, pre_lagged: Tensor, fn: Tensor,
             scale: Tensor, base: Tensor, norm_weight: Tensor, norm_eps: float, hc_eps: float,
             iters: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """out [..., D] bf16 (the previous sublayer); streams [..., hc, D] bf16; post [..., hc], comb [..., hc, hc],
    pre_lagged [..., hc] fp32; fn [(2+hc)hc, hc D], scale [3], base [(2+hc)hc] fp32; norm_weight [D] bf16.
    Returns (new streams bf16, normed bf16 [..., D], pre, post fp32 [..., hc], comb fp32 [..., hc, hc])."""
    check_seam_args(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight)
    return tuple(t.contiguous() for t in seam_reference(out, streams, post, comb, pre_lagged, fn, scale, base,
                                                        norm_weight, norm_eps, hc_eps, iters))


@mhc_seam.register_fake
def _(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight, norm_eps, hc_eps, iters):
    return (torch.empty_like(streams), torch.empty_like(out), *mixes_like(streams))


@torch.library.custom_op("dsflash::mhc_entry_seam", mutates_args=())
def mhc_entry_seam(streams: Tensor, pre_lagged: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                   norm_weight: Tensor, norm_eps: float, hc_eps: float,
                   iters: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mhc_seam without the expansion: the streams as given. Returns (normed, pre, post, comb)."""
    check_seam_args(None, streams, None, None, pre_lagged, fn, scale, base, norm_weight)
    return tuple(t.contiguous() for t in entry_seam_reference(streams, pre_lagged, fn, scale, base, norm_weight,
                                                              norm_eps, hc_eps, iters))


@mhc_entry_seam.register_fake
def _(streams, pre_lagged, fn, scale, base, norm_weight, norm_eps, hc_eps, iters):
    return (streams.new_empty(streams.shape[:-2] + streams.shape[-1:]), *mixes_like(streams))


def mixes_like(streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Empty (pre, post, comb) fp32 for streams [..., hc, D]."""
    lead, hc = streams.shape[:-2], streams.shape[-2]
    return (streams.new_empty(lead + (hc,), dtype=torch.float32), streams.new_empty(lead + (hc,), dtype=torch.float32),
            streams.new_empty(lead + (hc, hc), dtype=torch.float32))


try:  # Triton is optional on CPU machines
    from . import mhc_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    mhc_triton = None

if mhc_triton is not None:
    @mhc_seam.register_kernel("cuda")
    def _(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight, norm_eps, hc_eps, iters):
        check_seam_args(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight)
        if not mhc_triton.kernel_fits(streams, fn):
            return seam_reference(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight, norm_eps,
                                  hc_eps, iters)
        return mhc_triton.mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight,
                                          norm_eps, hc_eps, iters)

    @mhc_entry_seam.register_kernel("cuda")
    def _(streams, pre_lagged, fn, scale, base, norm_weight, norm_eps, hc_eps, iters):
        check_seam_args(None, streams, None, None, pre_lagged, fn, scale, base, norm_weight)
        if not mhc_triton.kernel_fits(streams, fn):
            return entry_seam_reference(streams, pre_lagged, fn, scale, base, norm_weight, norm_eps, hc_eps, iters)
        return mhc_triton.mhc_seam_triton(None, streams, None, None, pre_lagged, fn, scale, base, norm_weight,
                                          norm_eps, hc_eps, iters)
