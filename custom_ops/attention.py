"""`dsflash::attention_`: window ring + top-k compressed rows read straight from their cache records.

For each query token (all H heads share every key row: one K=V latent, MQA):
  keys = window entries widx[b, t, :] (index < W: ring slot, >= W: row index-W of this chunk's bf16 kv,
         -1: none; the caller puts the visible positions there, bounded-replay clamp included)
       + compressed entries cidx[b, t, :] (row of the compressed cache, -1: none)
  o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink_h}),  s_j = scale * q . k_j
  out = o with its trailing rope dims rotated back by the query position (inverse RoPE, fused)
Ring and compressed rows are records ("bf16", "fp8", "nvfp4"; see records.py) dequantized in registers:
no dequantized copy of the cache is ever written. The Triton kernel splits the key list over programs
for decode (batch 1 must fill the GPU) and merges the partial softmaxes by log-sum-exp.
"""

import torch
from torch import Tensor

from dsflash_compile.rope import apply_rope, rotation

from . import records

KEY_BLOCK = 64  # the release kernel's online-softmax block
_QUERY_CHUNK = 256  # queries per step of the reference (bounds the gathered-key memory)


def online_softmax(qf: Tensor, keys: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    """The release kernel's numerics: fp32 scores, online softmax over blocks of 64 keys in list order,
    probabilities rounded to bf16 (relative to the running max) for PV while the denominator sums them in
    fp32, the sink added once at the end. qf [B, S, H, d], keys [B, S, K, d], valid [B, S, K]."""
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


def _gather_rows(cache: Tensor, idx: Tensor, fmt: str, dim: int) -> Tensor:
    """cache [Bmax, N, rb] records (or bf16 rows), idx [B, s, k] -> bf16 [B, s, k, dim] (-1 reads row 0)."""
    batch = idx.shape[0]
    rows = torch.arange(batch, device=idx.device).view(batch, 1, 1)
    picked = cache[rows, idx.clamp_min(0).long()]
    return picked.to(torch.bfloat16) if fmt == "bf16" else records.decode_reference(picked, fmt, dim)


def attention_reference(out: Tensor, q: Tensor, ring: Tensor, chunk_kv: Tensor, widx: Tensor, compressed: Tensor,
                        cidx: Tensor, sink: Tensor, positions: Tensor, inv_freq: Tensor, scale: float,
                        window_fmt: str, compressed_fmt: str) -> None:
    batch, seq, heads, dim = q.shape
    window = ring.shape[1]
    rows = torch.arange(batch, device=q.device).view(batch, 1, 1)
    for start in range(0, seq, _QUERY_CHUNK):
        sl = slice(start, start + _QUERY_CHUNK)
        w = widx[:, sl].long()
        in_ring = (w >= 0) & (w < window)
        ring_keys = _gather_rows(ring, torch.where(in_ring, w, 0), window_fmt, dim)
        chunk_keys = chunk_kv[rows, (w - window).clamp_min(0)].to(torch.bfloat16)
        keys = torch.where(in_ring.unsqueeze(-1), ring_keys, chunk_keys)
        if cidx.shape[-1]:
            keys = torch.cat([keys, _gather_rows(compressed, cidx[:, sl], compressed_fmt, dim)], dim=2)
        valid = torch.cat([w >= 0, cidx[:, sl] >= 0], dim=-1)
        o = online_softmax(q[:, sl].float(), keys.float(), valid, sink.float(), scale).to(q.dtype)
        out[:, sl] = apply_rope(o, rotation(positions[:, sl].clamp_min(0), inv_freq), inverse=True)


@torch.library.custom_op("dsflash::attention_", mutates_args=("out",))
def attention_(out: Tensor, q: Tensor, ring: Tensor, chunk_kv: Tensor, widx: Tensor, compressed: Tensor,
               cidx: Tensor, sink: Tensor, positions: Tensor, inv_freq: Tensor, scale: float, window_fmt: str,
               compressed_fmt: str) -> None:
    """out, q [B, S, H, d] bf16; ring [Bmax, W, record] (window_fmt); chunk_kv [B, C, d] bf16, this chunk's
    keys (C >= S: the queries may be the chunk's last S columns only); widx [B, S, W'] int (< W ring slot,
    >= W chunk row + W, -1 none); compressed [Bmax, R, record]
    (compressed_fmt; R may be 0); cidx [B, S, K] int (-1 none); sink [H] fp32; positions [B, S];
    inv_freq [r/2] fp32 (the layer's RoPE: the output's trailing r dims are rotated back)."""
    attention_reference(out, q, ring, chunk_kv, widx, compressed, cidx, sink, positions, inv_freq, scale,
                        window_fmt, compressed_fmt)


@attention_.register_fake
def _(out, q, ring, chunk_kv, widx, compressed, cidx, sink, positions, inv_freq, scale, window_fmt,
      compressed_fmt):
    return None


try:  # Triton is optional on CPU machines
    from .attention_triton import attention_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    attention_triton = None

if attention_triton is not None:
    @attention_.register_kernel("cuda")
    def _(out, q, ring, chunk_kv, widx, compressed, cidx, sink, positions, inv_freq, scale, window_fmt,
          compressed_fmt):
        attention_triton(out, q, ring, chunk_kv, widx, compressed, cidx, sink, positions, inv_freq, scale,
                         window_fmt, compressed_fmt)
