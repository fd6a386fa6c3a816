"""An mHC seam whose mixes are finished later (issue 5): `dsflash::mhc_seam` / `mhc_entry_seam` as a seam op
that leaves its mixes as partials and a finishing op placed before the mixes' first reader, for the deferral
pass (passes/mhc_defer.py). With X the streams a seam receives (mhc.py gives the math):

    mhc_seam_partials(out, X, q, C, p_lagged, fn, w[, norm]) -> (X', normed, partials)
                                                       (norm=False: the collapse un-normed in normed's place, its
                                                       reader norms it: passes/seam_norm_gemv.py)
    mhc_entry_seam_partials(X, p_lagged, fn, w)        -> (normed, partials)
    mhc_mixes_finish(partials, scale, base, D, after, early) -> (p, q', C')   this seam's mixes
    mhc_seam_partials_routed(out, X, q, C, p_lagged, fn, w, gate, bias, k, ...)
                                                       -> (X', normed, partials, weights, ids)

partials [..., chunks, partial_width(hc)] fp32, one row per chunk of SEAM_BLOCK_D columns of D: the (2 + hc) hc
mix dot products of the chunk, the streams' sum of squares over it, the collapse's, then zeros. The finish adds
the rows in chunk order, then runs the mixes' RMS scaling, sigmoids and Sinkhorn (the model's split_mixes).

Why: at one token the seam's critical path is its mixes' finish, one program adding the partials and running 20
Sinkhorn rounds (H200, sweep_mhc.py --parts, 12-02 t: the seam 7.8 us, its mixes alone 7.5, its collapse alone
4.5), while lagged mHC first reads the mixes one sublayer later. Placed before that reader, the finishing kernel
computes them while the sublayer's last kernel still runs (mhc_mixes_finish_triton.py) and the seam ends after
its collapse (H200 B1 step, 12-03 x3: the two seams of a layer 7.5 and 5.6 us of the path against 10.4 and 8.2,
each finish 0.4; 10.54 ms a step against 10.75). `after` (never read) holds tensors the sublayer computed from
the seam's outputs: Inductor then issues the finish after them, which puts a kernel between the seam and the
finish, as the finish's early start (`early`, set by the pass) needs; without `early` the finish kernel waits
first, like any other. On CUDA the seam op runs the fused seam's kernel (any token count) with its finish of the
mixes switched off (a runtime flag) and the RMSNorm in one tile (NORM_BLOCK): X' and normed as the fused seam
computes them.

The routed seam (passes/router_seam.py, CompileOptions.router_in_seam) is the FFN's seam with the MoE's router:
normed's row is routed as dsflash::fused_router routes it (its reference is the two ops'). On CUDA the program that
norms a row routes it (ROUTE_MAX_EXPERTS experts at most), so the router's own launch, latency-bound at one token
(H200 B1 step, 12-03 y1: 5.8 us of the path a layer), leaves the step. Measured (12-03 z4) it does not pay: one
program streams the 80 KB gate in ~8.6 us (the seam 14.0 us of the path against 5.4 + 6.0 for seam and router), so
the option is off. The gate's tiles would need to be spread over the seam's 80 programs (each its 64 columns,
loaded before the wait for the row's RMS) to beat the router's launch; a first such kernel (12-03 z5: the last
program publishes the collapse's sum of squares, the others spin for it, norm their columns and add their share of
the logits, the last of those takes the top-k) failed its CUDA test at one token and was not kept.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .mhc import ROUTE_MAX_EXPERTS, SEAM_BLOCK_D, check_seam_args, partial_width, rms_norm
from .router import fused_router, fused_router_reference
from dsflash_compile.mhc import hc_post, hc_pre, split_mixes

# With the mixes deferred the collapse's RMSNorm is the seam's path: one tile of the whole row (H200, one token,
# sweep_mhc.py --parts, 12-03 x2: 4.66 us a seam against 5.21 in tiles of 1024)
NORM_BLOCK = 8192
# the deferral pass's largest seam: up to here the seam kernel runs chunks of SEAM_BLOCK_D columns
# (mhc_triton._columns_per_program), so the partials are the ones a fused seam adds
DEFER_MAX_TOKENS = 16


def mix_streams(base: Tensor) -> int:
    """hc of the mixes whose base has (2 + hc) hc entries."""
    return math.isqrt(base.shape[0] + 1) - 1


def partials_shape(streams_shape) -> tuple:
    """Shape of the partials of streams [..., hc, D]: [..., chunks, partial_width(hc)]."""
    *lead, hc, dim = streams_shape
    return (*lead, math.ceil(dim / SEAM_BLOCK_D), partial_width(hc))


def mix_partials(streams: Tensor, fn: Tensor, collapsed: Tensor) -> Tensor:
    """partials (module docstring) of streams [..., hc, D] bf16 with the mixes' fn [(2+hc)hc, hc D] and the
    collapse [..., D] bf16 (before its RMSNorm), in fp32."""
    *lead, hc, dim = streams.shape
    chunks, width = partials_shape(streams.shape)[-2:]
    mix, pad = fn.shape[0], chunks * SEAM_BLOCK_D - dim

    def chunked(x):  # [..., D] -> [..., chunks, SEAM_BLOCK_D], zero-padded
        return F.pad(x.float(), (0, pad)).unflatten(-1, (chunks, SEAM_BLOCK_D))

    x = chunked(streams)  # [..., hc, chunks, block]
    w = chunked(fn.unflatten(-1, (hc, dim)))  # [mix, hc, chunks, block]
    partials = streams.new_zeros(*lead, chunks, width, dtype=torch.float32)
    partials[..., :mix] = torch.einsum("...icb,micb->...cm", x, w)
    partials[..., mix] = x.square().sum((-3, -1))
    partials[..., mix + 1] = chunked(collapsed).square().sum(-1)
    return partials


def seam_partials_reference(out, streams, post, comb, pre_lagged, fn, norm_weight, norm_eps, norm=True):
    """(new streams, normed, partials); out/post/comb None: the entry seam, (normed, partials). norm=False: the
    collapse before its RMSNorm in place of normed (the reader norms it: passes/seam_norm_gemv.py)."""
    new = streams if out is None else hc_post(out, streams, post, comb)
    collapsed = hc_pre(new, pre_lagged)
    outputs = (rms_norm(collapsed, norm_weight, norm_eps) if norm else collapsed, mix_partials(new, fn, collapsed))
    return tuple(t.contiguous() for t in (outputs if out is None else (new, *outputs)))


def mixes_finish_reference(partials, scale, base, dim, norm_eps, hc_eps, iters):
    hc = mix_streams(base)
    mix = (2 + hc) * hc
    sums = partials.sum(-2)
    mixes = sums[..., :mix] * torch.rsqrt(sums[..., mix:mix + 1] / (hc * dim) + norm_eps)
    return tuple(t.contiguous() for t in split_mixes(mixes, hc, scale, base, hc_eps, iters))


def check_finish_args(partials, scale, base, dim) -> None:
    hc = mix_streams(base) if base.dim() == 1 else 0
    if base.dim() != 1 or (2 + hc) * hc != base.shape[0]:
        raise ValueError(f"mhc mixes finish: base has shape {tuple(base.shape)}; expected [(2 + hc) hc]")
    if tuple(scale.shape) != (3,):
        raise ValueError(f"mhc mixes finish: scale has shape {tuple(scale.shape)}; expected (3,)")
    want = partials_shape((hc, dim))
    if partials.dim() < 2 or tuple(partials.shape[-2:]) != want or partials.dtype != torch.float32:
        raise ValueError(f"mhc mixes finish: partials are {partials.dtype} {tuple(partials.shape)}; expected fp32 "
                         f"[..., {want[0]}, {want[1]}] for hc {hc} and D {dim}")


@torch.library.custom_op("dsflash::mhc_seam_partials", mutates_args=())
def mhc_seam_partials(out: Tensor, streams: Tensor, post: Tensor, comb: Tensor, pre_lagged: Tensor, fn: Tensor,
                      norm_weight: Tensor, norm_eps: float, norm: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(new streams bf16 [..., hc, D], normed bf16 [..., D], partials); arguments as dsflash::mhc_seam's.
    norm=False: the collapse before its RMSNorm in place of normed (seam_partials_reference)."""
    check_seam_args(out, streams, post, comb, pre_lagged, fn, None, None, norm_weight)
    return seam_partials_reference(out, streams, post, comb, pre_lagged, fn, norm_weight, norm_eps, norm)


@mhc_seam_partials.register_fake
def _(out, streams, post, comb, pre_lagged, fn, norm_weight, norm_eps, norm=True):
    return (torch.empty_like(streams), torch.empty_like(out),
            streams.new_empty(partials_shape(streams.shape), dtype=torch.float32))


@torch.library.custom_op("dsflash::mhc_entry_seam_partials", mutates_args=())
def mhc_entry_seam_partials(streams: Tensor, pre_lagged: Tensor, fn: Tensor, norm_weight: Tensor,
                            norm_eps: float) -> tuple[Tensor, Tensor]:
    """mhc_seam_partials without the expansion: (normed, partials) of the streams as given."""
    check_seam_args(None, streams, None, None, pre_lagged, fn, None, None, norm_weight)
    return seam_partials_reference(None, streams, None, None, pre_lagged, fn, norm_weight, norm_eps)


@mhc_entry_seam_partials.register_fake
def _(streams, pre_lagged, fn, norm_weight, norm_eps):
    return (streams.new_empty(streams.shape[:-2] + streams.shape[-1:]),
            streams.new_empty(partials_shape(streams.shape), dtype=torch.float32))


@torch.library.custom_op("dsflash::mhc_mixes_finish", mutates_args=())
def mhc_mixes_finish(partials: Tensor, scale: Tensor, base: Tensor, dim: int, norm_eps: float, hc_eps: float,
                     iters: int, after: list[Tensor], early: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(pre, post, comb) fp32 of a seam of streams [..., hc, dim], from its partials [..., chunks, PART];
    `after` is not read; early: the partials come from a kernel at least two launches back (module docstring)."""
    check_finish_args(partials, scale, base, dim)
    return mixes_finish_reference(partials, scale, base, dim, norm_eps, hc_eps, iters)


@mhc_mixes_finish.register_fake
def _(partials, scale, base, dim, norm_eps, hc_eps, iters, after, early=False):
    lead, hc = partials.shape[:-2], mix_streams(base)
    return (partials.new_empty(lead + (hc,)), partials.new_empty(lead + (hc,)), partials.new_empty(lead + (hc, hc)))


@torch.library.custom_op("dsflash::mhc_seam_partials_routed", mutates_args=())
def mhc_seam_partials_routed(out: Tensor, streams: Tensor, post: Tensor, comb: Tensor, pre_lagged: Tensor, fn: Tensor,
                             norm_weight: Tensor, norm_eps: float, gate: Tensor, gate_bias: Tensor, topk: int,
                             normalize: bool, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """mhc_seam_partials' three outputs, then dsflash::fused_router's two (weights fp32, ids int64 [tokens, topk])
    of the normed rows with this gate [E, D] and bias [E]."""
    check_seam_args(out, streams, post, comb, pre_lagged, fn, None, None, norm_weight)
    new, normed, partials = seam_partials_reference(out, streams, post, comb, pre_lagged, fn, norm_weight, norm_eps)
    return new, normed, partials, *fused_router_reference(normed.reshape(-1, normed.shape[-1]), gate, gate_bias,
                                                          topk, normalize, scale)


@mhc_seam_partials_routed.register_fake
def _(out, streams, post, comb, pre_lagged, fn, norm_weight, norm_eps, gate, gate_bias, topk, normalize, scale):
    tokens = out.numel() // out.shape[-1]
    return (torch.empty_like(streams), torch.empty_like(out),
            streams.new_empty(partials_shape(streams.shape), dtype=torch.float32),
            out.new_empty(tokens, topk, dtype=torch.float32), out.new_empty(tokens, topk, dtype=torch.int64))


try:  # Triton is optional on CPU machines
    from . import mhc_mixes_finish_triton, mhc_triton, router_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    mhc_triton = None

if mhc_triton is not None:
    def _seam_partials_cuda(out, streams, post, comb, pre_lagged, fn, norm_weight, norm_eps, norm=True):
        """Both seam ops on CUDA (out, post, comb None: the entry seam): the fused seam's kernel with its finish
        of the mixes off (and with norm=False its RMSNorm: no program finishes), where it takes the shapes."""
        check_seam_args(out, streams, post, comb, pre_lagged, fn, None, None, norm_weight)
        if not mhc_triton.kernel_fits(streams, fn):
            return seam_partials_reference(out, streams, post, comb, pre_lagged, fn, norm_weight, norm_eps, norm)
        return mhc_triton.mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, None, None, norm_weight, norm_eps,
                                          0.0, 0, block_d=SEAM_BLOCK_D, norm_block=NORM_BLOCK, rows=False,
                                          finish_mixes=False, norm=norm)

    mhc_seam_partials.register_kernel("cuda")(_seam_partials_cuda)

    @mhc_seam_partials_routed.register_kernel("cuda")
    def _(out, streams, post, comb, pre_lagged, fn, norm_weight, norm_eps, gate, gate_bias, topk, normalize, scale):
        tokens = out.numel() // out.shape[-1]
        route = (gate, gate_bias, topk, normalize, scale)
        if (not mhc_triton.kernel_fits(streams, fn) or gate.shape[0] > ROUTE_MAX_EXPERTS
                or not router_triton.kernel_fits(out.reshape(tokens, -1), gate, gate_bias, topk)):
            new, normed, partials = _seam_partials_cuda(out, streams, post, comb, pre_lagged, fn, norm_weight,
                                                        norm_eps)
            return new, normed, partials, *fused_router(normed.reshape(tokens, -1), *route)
        check_seam_args(out, streams, post, comb, pre_lagged, fn, None, None, norm_weight)
        return mhc_triton.mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, None, None, norm_weight, norm_eps,
                                          0.0, 0, block_d=SEAM_BLOCK_D, norm_block=NORM_BLOCK, rows=False,
                                          finish_mixes=False, route=route)

    @mhc_entry_seam_partials.register_kernel("cuda")
    def _(streams, pre_lagged, fn, norm_weight, norm_eps):
        return _seam_partials_cuda(None, streams, None, None, pre_lagged, fn, norm_weight, norm_eps)

    @mhc_mixes_finish.register_kernel("cuda")
    def _(partials, scale, base, dim, norm_eps, hc_eps, iters, after, early=False):
        check_finish_args(partials, scale, base, dim)
        return mhc_mixes_finish_triton.mhc_mixes_finish_triton(partials, scale, base, mix_streams(base), dim,
                                                                norm_eps, hc_eps, iters, early)
