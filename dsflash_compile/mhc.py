"""Lagged manifold-constrained hyper-connections (MODEL.md section 2), as plain readable PyTorch.

The residual is carried as `hc` streams [..., hc, D] in bf16. Each seam computes, from the streams it
receives, a pre-mix (collapse weights), a post-mix (expansion weights) and a doubly stochastic 4x4 comb
(Sinkhorn). The pre-mix a seam computes is used one sublayer later (lagged). A later issue fuses a seam
into one op with an FX pass; this file is the pattern that pass matches, so keep it plain.
"""

from typing import NamedTuple

import torch


def sinkhorn(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., hc, hc] logits -> doubly stochastic comb. Softmax over b (rows) + eps, column
    normalisation, then (iters - 1) rounds of row then column normalisation, all fp32.
    The softmax is written out (exp(x - max) / sum) because that is the reference's rounding."""
    comb = torch.exp(comb_logits - comb_logits.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    """streams [..., hc, D] -> (pre [..., hc], post [..., hc], comb [..., hc, hc]), fp32.

    One RMS statistic over all hc * D values scales the [24]-wide projection; the first hc entries give
    the pre-mix, the next hc the post-mix, the last hc * hc the comb logits (row a = input stream).
    """
    flat = streams.flatten(-2).float()
    mixes = torch.nn.functional.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return split_mixes(mixes, streams.shape[-2], scale, base, hc_eps, sinkhorn_iters)


def split_mixes(mixes: torch.Tensor, hc: int, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
                sinkhorn_iters: int):
    """The RMS-scaled projection [..., (2 + hc) hc] -> (pre, post, comb), as hc_mixes describes."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    return pre, post, sinkhorn(comb_logits, sinkhorn_iters, hc_eps)


def hc_pre(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse: sum_i pre_i * X_i in fp32, cast to the stream dtype. [..., hc, D] -> [..., D]."""
    return torch.sum(pre.unsqueeze(-1) * streams.float(), dim=-2).to(streams.dtype)


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand: Y_j = post_j * out + sum_i comb[i, j] * X_i (fp32), cast to the stream dtype."""
    mixed = torch.sum(comb.unsqueeze(-1) * streams.unsqueeze(-2), dim=-3)
    return (post.unsqueeze(-1) * out.unsqueeze(-2) + mixed).to(streams.dtype)


class PendingPost(NamedTuple):
    """A sublayer's output with its expansion into the streams not yet done: hc_post(out, streams, post, comb).
    A block hands the next one its MoE's this way, so that the next block's first seam (compiled with it, as
    each block is compiled alone) expands it, and the seam fusion takes the expansion into its one op."""
    out: torch.Tensor
    streams: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


def expanded(streams: "torch.Tensor | PendingPost") -> torch.Tensor:
    """The streams, with a pending expansion done."""
    return hc_post(*streams) if isinstance(streams, PendingPost) else streams
