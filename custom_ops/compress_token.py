"""`dsflash::compress_token_`: a KV source's compressor after its projection, in a one-token step, as one launch
(issue 5).

In a decode step a KV source's compressor ran as seven kernels between the attention's input projection and wq_b,
each a few programs on a 512-value row (H200 B1, 12-05 g3 trace, layer 2: the pooling 3.8 us of the path, the keys'
wk GEMM 3.5, their norm 1.6, RoPE 1.1 and record write 1.6, the compressed row's RoPE 0.7 and record write 2.1: 14.4
us, in each of the 4 KV sources). Here one program a batch row does all of it (compress_token_triton.py):

    latent = RMSNorm(softmax_pool(kv, score, ...))       ratio > 1 (pooling.py; the pending state updated)
             RMSNorm(kv)                                   ratio 1
    keys   = RoPE(RMSNorm(latent @ key_weight^T))         index sources: -> index_keys[b, row]
    compressed[b, row] = RoPE(latent)

with the model's roundings (bf16 after the pooling, each norm, the keys' projection and each RoPE), the FP4
quantize-dequantize of each where `quantize` and its record format is not already that grid (nvfp4 for the
compressed row, mxfp4 for the keys: records.py), and row = row_ids[b, 0] (< 0: the group is still open, or below
the write floor: no record written; the pending state is written either way). The reference is the model's own
functions (attention.Compressor, Indexer.keys, Attention._compress), with records written by record_write_.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dsflash_compile.pooling import softmax_pool
from dsflash_compile.quant import fp4_qdq_e4m3, fp4_qdq_ue8m0
from dsflash_compile.rope import apply_rope

from . import records
from .mhc import rms_norm

NATIVE = {"compressed": "nvfp4", "index": "mxfp4"}  # the record formats that store the QDQ's grid itself


def _check(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids, rot, weight,
           key_weight, key_norm_weight, compressed_fmt, index_fmt) -> None:
    """Errors that name the problem (metadata only: no device sync)."""
    if kv.dim() != 3 or kv.shape[1] != 1:
        raise ValueError(f"compress_token_: kv {tuple(kv.shape)} must be one token a batch row, [B, 1, D] "
                         "(a decode step; longer chunks run the compressor's own path)")
    batch, _, dim = kv.shape
    pooled = score is not None
    if (pending_kv is None, pending_score is None, source is None, complete is None) != (not pooled,) * 4:
        raise ValueError("compress_token_: score, pending_kv, pending_score, source and complete come together "
                         "(ratio > 1) or not at all (ratio 1)")
    if weight.dtype != torch.bfloat16 or tuple(weight.shape) != (dim,):
        raise ValueError(f"compress_token_: weight must be bf16 ({dim},), got {weight.dtype} {tuple(weight.shape)}")
    if pooled:
        ratio = pending_kv.shape[1]
        if kv.dtype != torch.float32 or score.dtype != torch.float32 or score.shape != kv.shape:
            raise TypeError(f"compress_token_: a ratio > 1 compressor pools fp32 kv and score of one shape, got "
                            f"{kv.dtype} {tuple(kv.shape)} and {score.dtype} {tuple(score.shape)}")
        for name, t in (("pending_kv", pending_kv), ("pending_score", pending_score)):
            if t.dtype != torch.float32 or t.dim() != 3 or t.shape[0] < batch or t.shape[1:] != (ratio, dim):
                raise ValueError(f"compress_token_: {name} must be fp32 [Bmax >= {batch}, ratio, {dim}], got "
                                 f"{t.dtype} {tuple(t.shape)}")
        if tuple(source.shape) != (batch, 2 * ratio) or tuple(complete.shape) != (batch,):
            raise ValueError(f"compress_token_: source {tuple(source.shape)} and complete {tuple(complete.shape)} "
                             f"must be a one-token step's ({batch}, {2 * ratio}) and ({batch},) (context.GroupRows)")
        groups = 2
    else:
        if kv.dtype != torch.bfloat16:
            raise TypeError(f"compress_token_: a ratio 1 compressor normalises its bf16 projection, got {kv.dtype}")
        groups = 1
    if tuple(row_ids.shape) != (batch, groups) or row_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"compress_token_: row_ids must be int64/int32 ({batch}, {groups}), got {row_ids.dtype} "
                         f"{tuple(row_ids.shape)}")
    if rot.dtype != torch.float32 or rot.dim() != 4 or rot.shape[:2] != row_ids.shape or rot.shape[-1] != 2:
        raise ValueError(f"compress_token_: rot must be fp32 ({batch}, {groups}, pairs, 2), got {rot.dtype} "
                         f"{tuple(rot.shape)}")
    meta = dict(dtype=torch.bfloat16, device="meta")
    records._check_write(compressed, torch.empty(batch, groups, dim, **meta), row_ids, compressed_fmt)
    if index_keys is not None:
        if key_weight is None or key_norm_weight is None:
            raise ValueError("compress_token_: index_keys needs key_weight and key_norm_weight")
        key_dim = key_weight.shape[0]
        if key_weight.dtype != torch.bfloat16 or tuple(key_weight.shape) != (key_dim, dim) or \
                key_norm_weight.dtype != torch.bfloat16 or tuple(key_norm_weight.shape) != (key_dim,):
            raise ValueError(f"compress_token_: key_weight must be bf16 (Dk, {dim}) and key_norm_weight bf16 (Dk,), "
                             f"got {key_weight.dtype} {tuple(key_weight.shape)} and {key_norm_weight.dtype} "
                             f"{tuple(key_norm_weight.shape)}")
        records._check_write(index_keys, torch.empty(batch, groups, key_dim, **meta), row_ids, index_fmt)
        if index_keys.shape[1] != compressed.shape[1]:
            raise ValueError(f"compress_token_: index_keys has {index_keys.shape[1]} rows, compressed "
                             f"{compressed.shape[1]}: a row id names one row of each")
        dim = min(dim, key_dim)
    if 2 * rot.shape[-2] > dim:
        raise ValueError(f"compress_token_: {rot.shape[-2]} rotated pairs do not fit rows of {dim} values")


def compress_token(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids, rot,
                   weight, eps, key_weight, key_norm_weight, key_eps, quantize, compressed_fmt, index_fmt,
                   write=records.record_write_reference) -> None:
    """The op's math, its records written by `write` (record_write_'s arguments): the reference's, or on CUDA inputs
    the kernel does not take the record_write_ op (its kernel keeps the step free of host syncs)."""
    if score is None:
        latent = rms_norm(kv, weight, eps)
    else:
        latent = rms_norm(softmax_pool(kv, score, source, complete, pending_kv, pending_score).to(torch.bfloat16),
                          weight, eps)
    if index_keys is not None:
        keys = apply_rope(rms_norm(F.linear(latent, key_weight), key_norm_weight, key_eps), rot)
        write(index_keys, fp4_qdq_ue8m0(keys) if quantize and index_fmt != NATIVE["index"] else keys, row_ids,
              index_fmt)
    latent = apply_rope(latent, rot)
    write(compressed, fp4_qdq_e4m3(latent) if quantize and compressed_fmt != NATIVE["compressed"] else latent,
          row_ids, compressed_fmt)


def compress_token_reference(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids,
                             rot, weight, eps, key_weight, key_norm_weight, key_eps, quantize, compressed_fmt,
                             index_fmt) -> None:
    _check(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids, rot, weight,
           key_weight, key_norm_weight, compressed_fmt, index_fmt)
    compress_token(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids, rot,
                   weight, eps, key_weight, key_norm_weight, key_eps, quantize, compressed_fmt, index_fmt)


@torch.library.custom_op("dsflash::compress_token_",
                         mutates_args=("compressed", "index_keys", "pending_kv", "pending_score"))
def compress_token_(compressed: Tensor, index_keys: Optional[Tensor], pending_kv: Optional[Tensor],
                    pending_score: Optional[Tensor], kv: Tensor, score: Optional[Tensor], source: Optional[Tensor],
                    complete: Optional[Tensor], row_ids: Tensor, rot: Tensor, weight: Tensor, eps: float,
                    key_weight: Optional[Tensor], key_norm_weight: Optional[Tensor], key_eps: float, quantize: bool,
                    compressed_fmt: str, index_fmt: str) -> None:
    """compressed [Bmax, N, record] (compressed_fmt) and index_keys [Bmax, N, record] (index_fmt; None: a KV source
    without an indexer) get row row_ids[b, 0] where >= 0; kv [B, 1, D]: the compressor's projection (ratio 1 bf16;
    ratio r > 1 fp32, with score, pending_kv / pending_score fp32 [Bmax, r, D] (updated), and the step's
    context.GroupRows source [B, 2r], complete [B]); row_ids [B, groups], rot fp32 [B, groups, pairs, 2]: GroupRows'
    (groups 2 at r > 1, else 1); weight bf16 [D], eps: the compressor's norm; key_weight bf16 [Dk, D],
    key_norm_weight bf16 [Dk], key_eps: the indexer's wk and k_norm."""
    compress_token_reference(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids,
                             rot, weight, eps, key_weight, key_norm_weight, key_eps, quantize, compressed_fmt,
                             index_fmt)


@compress_token_.register_fake
def _(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids, rot, weight, eps,
      key_weight, key_norm_weight, key_eps, quantize, compressed_fmt, index_fmt):
    _check(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids, rot, weight,
           key_weight, key_norm_weight, compressed_fmt, index_fmt)


try:  # Triton is optional on CPU machines
    from . import compress_token_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    compress_token_triton = None

if compress_token_triton is not None:
    @compress_token_.register_kernel("cuda")
    def _(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids, rot, weight, eps,
          key_weight, key_norm_weight, key_eps, quantize, compressed_fmt, index_fmt):
        _check(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids, rot, weight,
               key_weight, key_norm_weight, compressed_fmt, index_fmt)
        args = (compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids, rot, weight,
                eps, key_weight, key_norm_weight, key_eps, quantize, compressed_fmt, index_fmt)
        keyed = index_keys is not None
        # with quantize, the kernel writes the records whose encoding is the QDQ itself
        native = compressed_fmt == NATIVE["compressed"] and (not keyed or index_fmt == NATIVE["index"])
        fits = compress_token_triton.kernel_fits(kv, pending_kv, key_weight if keyed else None)
        if fits and (native or not quantize):
            compress_token_triton.compress_token_triton(*args)
        else:
            compress_token(*args, write=torch.ops.dsflash.record_write_)
