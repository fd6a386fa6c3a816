"""`dsflash::sparse_attention`: one query head group against gathered window and compressed keys.

Every query attends to the keys listed for it: window keys `kv[b, idx[b, t, :]]` followed by compressed
keys `ckv[b, cidx[b, t, :]]` (index -1 = no key). K = V (one shared latent per position); each head has a
sink logit that enters the softmax denominator only (MODEL.md section 4).

Reference numerics (the release kernel's): scores in fp32, online softmax over blocks of 64 keys in list
order, probabilities rounded to bf16 (relative to the running max) before the PV product while the
denominator sums the fp32 probabilities, the sink added once at the end, output bf16. A query with no
valid key returns zeros.
"""

import torch
from torch import Tensor

KEY_BLOCK = 64
_QUERY_CHUNK = 512  # queries per step of the reference, to bound the gathered-key memory


def sparse_attention_reference(q: Tensor, kv: Tensor, idx: Tensor, ckv: Tensor, cidx: Tensor, sink: Tensor,
                               scale: float) -> Tensor:
    batch, seq, heads, dim = q.shape
    out = torch.empty_like(q)
    rows = torch.arange(batch, device=q.device).view(batch, 1, 1)
    for start in range(0, seq, _QUERY_CHUNK):
        sl = slice(start, start + _QUERY_CHUNK)
        keys = torch.cat([kv[rows, idx[:, sl].clamp_min(0).long()], ckv[rows, cidx[:, sl].clamp_min(0).long()]], 2)
        valid = torch.cat([idx[:, sl] >= 0, cidx[:, sl] >= 0], dim=-1)
        out[:, sl] = _online_softmax(q[:, sl].float(), keys.float(), valid, sink.float(), scale).to(q.dtype)
    return out


def _online_softmax(qf: Tensor, keys: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    batch, seq, heads, dim = qf.shape
    scale_t = torch.tensor(scale, dtype=torch.float32, device=qf.device)
    acc = qf.new_zeros(batch, seq, heads, dim)
    denom = qf.new_zeros(batch, seq, heads)
    running_max = qf.new_full((batch, seq, heads), -1e30)  # finite: an all-invalid row stays 0, not NaN
    for k0 in range(0, keys.shape[2], KEY_BLOCK):
        blk, ok = keys[:, :, k0:k0 + KEY_BLOCK], valid[:, :, k0:k0 + KEY_BLOCK]
        blk = torch.where(ok.unsqueeze(-1), blk, 0.0)  # a -1 slot gathered row 0: never let it through
        scores = torch.einsum("bmhd,bmkd->bmhk", qf, blk)
        scores = torch.where(ok.unsqueeze(2), scores, -torch.inf) * scale_t
        previous = running_max
        running_max = torch.maximum(previous, scores.amax(dim=-1))
        rescale = torch.exp(previous - running_max)
        p = torch.exp(scores - running_max.unsqueeze(-1))
        denom = denom * rescale + p.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p.to(torch.bfloat16).float(), blk)
    denom = denom + torch.exp(sink - running_max)
    return acc / denom.unsqueeze(-1)


@torch.library.custom_op("dsflash::sparse_attention", mutates_args=())
def sparse_attention(q: Tensor, kv: Tensor, idx: Tensor, ckv: Tensor, cidx: Tensor, sink: Tensor,
                     scale: float) -> Tensor:
    """q [B, S, H, d] bf16; kv [B, N, d]; idx [B, S, Kw] int (-1 = none); ckv [B, R, d]; cidx [B, S, Kc];
    sink [H] fp32. Returns [B, S, H, d] in q's dtype."""
    return sparse_attention_reference(q, kv, idx, ckv, cidx, sink, scale)


@sparse_attention.register_fake
def _(q, kv, idx, ckv, cidx, sink, scale):
    return torch.empty_like(q)
