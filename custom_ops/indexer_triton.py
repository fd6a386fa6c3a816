"""Triton kernel of `dsflash::candidate_scores` (the candidate-only "sparse MQA logits" of MODEL.md 4.2).

Grid: (query token, tile of BLOCK_C candidate columns). A program loads the token's index query
[H, D] and head weights once, gathers the key rows its columns name (bf16, or MXFP4 records dequantized
in registers: D/2 packed E2M1 + D/32 UE8M0), and computes sum_h w_h relu(q_h . k) with the reference's
rounding points (q.k rounded to bf16, times w rounded to bf16, head sum in fp32 rounded to bf16).
Only the published candidates are scored: [tokens, nb * bs] instead of [tokens, context].

Not registered for CUDA yet: it has run under the Triton interpreter only (tests/test_indexer_triton.py);
registering it waits for a GPU check against the reference and the issue's benchmark.
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot, _e2m1_rows

BLOCK_C = 32


@triton.jit
def _candidate_scores_kernel(q_ptr, w_ptr, keys_ptr, blocks_ptr, visible_ptr, out_ptr, S, NB, keys_sb, keys_sr,
                             H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_C: tl.constexpr,
                             MXFP4: tl.constexpr, FP32_DOT: tl.constexpr):
    tok = tl.program_id(0)
    tile = tl.program_id(1)
    b = tok // S
    h = tl.arange(0, H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok.to(tl.int64) * H * D + h[:, None] * D + d[None, :])
    w = tl.load(w_ptr + tok.to(tl.int64) * H + h).to(tl.float32)
    visible = tl.load(visible_ptr + tok)

    c = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    in_range = c < NB * BS
    block = tl.load(blocks_ptr + tok.to(tl.int64) * NB + c // BS, mask=in_range, other=-1)
    row = block * BS + c % BS
    ok = (block >= 0) & (row < visible)
    base = keys_ptr + b.to(tl.int64) * keys_sb + row[:, None].to(tl.int64) * keys_sr
    if MXFP4:
        packed = tl.load(base + tl.arange(0, D // 2)[None, :], mask=ok[:, None], other=0).to(tl.int32)
        exps = tl.load(base + D // 2 + tl.arange(0, D // 32)[None, :], mask=ok[:, None], other=127).to(tl.int32)
        scale = (exps << 23).to(tl.float32, bitcast=True)[:, :, None]  # UE8M0: the fp32 exponent field
        k = _e2m1_rows(packed, scale, BLOCK_C, D, 32).to(tl.bfloat16)
    else:
        k = tl.load(base + d[None, :], mask=ok[:, None], other=0.0)

    s = _dot(q, tl.trans(k), FP32_DOT).to(tl.bfloat16).to(tl.float32)  # [H, BLOCK_C], bf16 like the einsum
    s = (tl.maximum(s, 0.0) * w[:, None]).to(tl.bfloat16).to(tl.float32)
    score = tl.sum(s, axis=0).to(tl.bfloat16).to(tl.float32)
    score = tl.where(ok, score, float("-inf"))
    tl.store(out_ptr + tok.to(tl.int64) * NB * BS + c, score.to(tl.bfloat16), mask=in_range)


def candidate_scores_triton(q, weights, keys, blocks, block_size, visible, fmt):
    """q [B, S, H, D] bf16; weights [B, S, H] bf16; keys [B', R, D] bf16 or mxfp4 records [B', R, D/2 + D/32];
    blocks [B, S, nb] int (-1 none); visible [B, S]. Returns bf16 [B, S, nb * block_size]."""
    batch, seq, heads, dim = q.shape
    nb = blocks.shape[-1]
    if fmt not in ("bf16", "mxfp4"):
        raise ValueError(f"candidate_scores_triton: keys format {fmt!r} is not bf16 or mxfp4")
    out = q.new_empty(batch, seq, nb * block_size)
    if nb == 0:
        return out
    grid = (batch * seq, triton.cdiv(nb * block_size, BLOCK_C))
    _candidate_scores_kernel[grid](
        q.contiguous(), weights.contiguous(), keys, blocks.to(torch.int32).contiguous(),
        visible.to(torch.int32).contiguous(), out, seq, nb, keys.stride(0), keys.stride(1),
        H=heads, D=dim, BS=block_size, BLOCK_C=BLOCK_C, MXFP4=fmt == "mxfp4", FP32_DOT=q.device.type != "cuda")
    return out
