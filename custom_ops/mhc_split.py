"""The mHC seam split for overlap (issue 8): the sublayer's input on the critical path, the seam's mixes on the
side stream (custom_ops/side_stream.py), and the join before the mixes' first reader.

With X the streams a seam receives (mhc.py gives the math):

    mhc_seam_input(out, X, q, C, p_lagged, w) -> (X', normed)    X' = post(out, X, q, C)
                                                                 normed = rms(pre(X', p_lagged))
    mhc_entry_input(X, p_lagged, w)           -> normed          the same without the expansion
    mhc_mixes(X', fn, scale, base)            -> (p, q, C)       forked: runs beside the next sublayer
    mhc_join_(p, q, C, after)                                    the current stream waits for the fork

Lagged mHC is what makes this legal: the mixes a seam computes are first read one seam later (after the
sublayer), so only that reader waits. `mhc_join_` is declared to mutate its arguments, though it only waits:
that makes Inductor order every later reader of (p, q, C) after it, with no copy. The passes
(passes/mhc_overlap.py) turn a fused `mhc_seam` / `mhc_entry_seam` into these ops.

Each op's values are the fused op's, bit for bit: the references are the same mhc.py functions, and on CUDA
the same Triton kernel runs with the other half's work switched off (mhc_triton.py). On CUDA that holds below
mhc.ROWS_MIN_TOKENS tokens: from there the fused seam runs the rows kernels, which sum in
another order (the overlap pass splits decode-sized seams, CompileOptions.mhc_overlap_max_tokens).
"""

import torch
from torch import Tensor

from . import side_stream
from .mhc import check_seam_args, mixes_like, rms_norm
from dsflash_compile.mhc import hc_mixes, hc_post, hc_pre


def seam_input_reference(out, streams, post, comb, pre_lagged, norm_weight, norm_eps):
    streams = hc_post(out, streams, post, comb)
    return streams.contiguous(), rms_norm(hc_pre(streams, pre_lagged), norm_weight, norm_eps).contiguous()


def entry_input_reference(streams, pre_lagged, norm_weight, norm_eps):
    return rms_norm(hc_pre(streams, pre_lagged), norm_weight, norm_eps).contiguous()


def mixes_reference(streams, fn, scale, base, norm_eps, hc_eps, iters):
    return tuple(t.contiguous() for t in hc_mixes(streams, fn, scale, base, norm_eps, hc_eps, iters))


@torch.library.custom_op("dsflash::mhc_seam_input", mutates_args=())
def mhc_seam_input(out: Tensor, streams: Tensor, post: Tensor, comb: Tensor, pre_lagged: Tensor, norm_weight: Tensor,
                   norm_eps: float) -> tuple[Tensor, Tensor]:
    """(new streams bf16 [..., hc, D], normed bf16 [..., D]); arguments as dsflash::mhc_seam's."""
    check_seam_args(out, streams, post, comb, pre_lagged, None, None, None, norm_weight)
    return seam_input_reference(out, streams, post, comb, pre_lagged, norm_weight, norm_eps)


@mhc_seam_input.register_fake
def _(out, streams, post, comb, pre_lagged, norm_weight, norm_eps):
    return torch.empty_like(streams), torch.empty_like(out)


@torch.library.custom_op("dsflash::mhc_entry_input", mutates_args=())
def mhc_entry_input(streams: Tensor, pre_lagged: Tensor, norm_weight: Tensor, norm_eps: float) -> Tensor:
    """normed bf16 [..., D] of the streams as given."""
    check_seam_args(None, streams, None, None, pre_lagged, None, None, None, norm_weight)
    return entry_input_reference(streams, pre_lagged, norm_weight, norm_eps)


@mhc_entry_input.register_fake
def _(streams, pre_lagged, norm_weight, norm_eps):
    return streams.new_empty(streams.shape[:-2] + streams.shape[-1:])


@torch.library.custom_op("dsflash::mhc_mixes", mutates_args=())
def mhc_mixes(streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm_eps: float, hc_eps: float,
              iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """(pre, post, comb) fp32 of the streams, forked onto the side stream on CUDA; join with mhc_join_."""
    check_seam_args(None, streams, None, None, None, fn, scale, base, None)
    return side_stream.fork(streams.device, lambda: mixes_reference(streams, fn, scale, base, norm_eps, hc_eps, iters),
                            [streams, fn, scale, base])


@mhc_mixes.register_fake
def _(streams, fn, scale, base, norm_eps, hc_eps, iters):
    return mixes_like(streams)


@torch.library.custom_op("dsflash::mhc_join_", mutates_args=("pre", "post", "comb"))
def mhc_join_(pre: Tensor, post: Tensor, comb: Tensor, after: list[Tensor]) -> None:
    """The current stream waits for the forked mixes (pre, post, comb) before anything reads them. `after`:
    the sublayer's results, only read so that Inductor issues the join after the sublayer (with no input
    from it, its scheduler moves the join up to the fork and nothing overlaps)."""
    side_stream.join(pre.device)


try:  # Triton is optional on CPU machines
    from . import mhc_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    mhc_triton = None

if mhc_triton is not None:
    # the fused seam's kernel with one half switched off; kernel_fits without fn: the pass splits only seams
    # whose fn is fp32 (mhc_overlap.py), so a split seam runs its kernel exactly where the fused one would
    @mhc_seam_input.register_kernel("cuda")
    def _(out, streams, post, comb, pre_lagged, norm_weight, norm_eps):
        check_seam_args(out, streams, post, comb, pre_lagged, None, None, None, norm_weight)
        if not mhc_triton.kernel_fits(streams):
            return seam_input_reference(out, streams, post, comb, pre_lagged, norm_weight, norm_eps)
        return mhc_triton.mhc_seam_triton(out, streams, post, comb, pre_lagged, None, None, None, norm_weight,
                                          norm_eps, 0.0, 0, mixes=False)

    @mhc_entry_input.register_kernel("cuda")
    def _(streams, pre_lagged, norm_weight, norm_eps):
        check_seam_args(None, streams, None, None, pre_lagged, None, None, None, norm_weight)
        if not mhc_triton.kernel_fits(streams):
            return entry_input_reference(streams, pre_lagged, norm_weight, norm_eps)
        return mhc_triton.mhc_seam_triton(None, streams, None, None, pre_lagged, None, None, None, norm_weight,
                                          norm_eps, 0.0, 0, mixes=False)[0]

    @mhc_mixes.register_kernel("cuda")
    def _(streams, fn, scale, base, norm_eps, hc_eps, iters):
        check_seam_args(None, streams, None, None, None, fn, scale, base, None)
        if not mhc_triton.kernel_fits(streams, fn):
            def mixes():
                return mixes_reference(streams, fn, scale, base, norm_eps, hc_eps, iters)
        else:
            def mixes():
                return mhc_triton.mhc_seam_triton(None, streams, None, None, None, fn, scale, base, None, norm_eps,
                                                  hc_eps, iters, collapse=False)
        return side_stream.fork(streams.device, mixes, [streams, fn, scale, base])
