"""Triton kernels of the lightning indexer's scores (MODEL.md 4.2): `dsflash::indexer_scores` (dense),
`dsflash::candidate_scores` (candidate-only "sparse MQA logits") and the block maxima of
`dsflash::candidate_blocks`.

Both scoring kernels compute sum_h w_h relu(q_h . k) with the reference's rounding points (q.k rounded
to bf16, times w rounded to bf16, head sum in fp32 rounded to bf16), reading bf16 keys or MXFP4 records
(D/2 packed E2M1 + D/32 UE8M0 bytes) dequantized in registers, so no decoded copy of the cache exists.
Index tensors (visible counts, block ids) are read in their own integer dtype: no conversion launches.
MQA: one key tile serves every head of a query token, as the N side of one tensor-core dot whose M side
is the tile's heads (padded to 16, tl.dot's minimum; padded heads have q = w = 0 and add 0).

  dense      grid (query tile of TQ tokens of one sequence, run of key tiles). M = TQ x heads (32 x 4
             in prefill: the key tile is loaded once for 4 tokens). A key tile at or past the largest
             visible count of the tile's queries is not read, only written as -inf.
  candidate  grid (query token, run of tiles of BLOCK_C candidate columns): gathers the key rows its
             columns name; scores [tokens, nb * bs] instead of [tokens, context].
  block max  grid (query token, tile of blocks): max over each block of bs scores, +inf for the block
             of the newest visible row; the top-k of candidate_blocks then runs on these (topk_triton).
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot, _e2m1_rows, _num_sms
from .topk_triton import top_blocks_triton

BLOCK_C = 32  # candidate columns per tile
BLOCK_N = 64  # dense: keys per tile
BLOCK_B = 128  # block max: blocks per program
DENSE_TOKENS = 4  # dense prefill: query tokens sharing a key tile
FORMATS = ("bf16", "mxfp4")


@triton.jit
def _load_queries(q_ptr, w_ptr, tok0, n_tok, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                  TQ: tl.constexpr):
    """q of tokens tok0 .. tok0 + TQ - 1 as [TQ * HP, D] bf16 (row = token * HP + head) and their head
    weights [TQ * HP] fp32; tokens past n_tok and heads past H read as 0."""
    r = tl.arange(0, TQ * HP)
    head = r % HP
    live = (r // HP < n_tok) & (head < H)
    row = (tok0 + r // HP).to(tl.int64) * H + head
    q = tl.load(q_ptr + row[:, None] * D + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)
    w = tl.load(w_ptr + row, mask=live, other=0.0).to(tl.float32)
    return q, w


@triton.jit
def _load_keys(base, rows, row_stride, ok, D: tl.constexpr, MXFP4: tl.constexpr):
    """Key rows `rows` [N] -> bf16 [N, D]: bf16 rows, or MXFP4 records decoded exactly (E2M1 x 2^e fits
    bf16); rows where ok is False read as 0 and are never touched in memory."""
    N: tl.constexpr = rows.shape[0]
    ptr = base + rows[:, None].to(tl.int64) * row_stride
    if MXFP4:
        packed = tl.load(ptr + tl.arange(0, D // 2)[None, :], mask=ok[:, None], other=0).to(tl.int32)
        exps = tl.load(ptr + D // 2 + tl.arange(0, D // 32)[None, :], mask=ok[:, None], other=127).to(tl.int32)
        scale = (exps << 23).to(tl.float32, bitcast=True)[:, :, None]  # UE8M0: the fp32 exponent field
        return _e2m1_rows(packed, scale, N, D, 32).to(tl.bfloat16)
    else:
        return tl.load(ptr + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _index_scores(q, w, k, TQ: tl.constexpr, HP: tl.constexpr, FP32_DOT: tl.constexpr):
    """sum_h w_h relu(q_h . k) -> fp32 [TQ, N] holding bf16 values, rounded where the reference rounds."""
    N: tl.constexpr = k.shape[0]
    s = _dot(q, tl.trans(k), FP32_DOT).to(tl.bfloat16).to(tl.float32)  # [TQ * HP, N], bf16 like the einsum
    s = (tl.maximum(s, 0.0) * w[:, None]).to(tl.bfloat16).to(tl.float32)
    return tl.sum(tl.reshape(s, (TQ, HP, N)), axis=1).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _dense_scores_kernel(q_ptr, w_ptr, keys_ptr, visible_ptr, out_ptr, S, num_rows, tiles_per_program,
                         keys_sb, keys_sr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, TQ: tl.constexpr,
                         BLOCK_N: tl.constexpr, MXFP4: tl.constexpr, FP32_DOT: tl.constexpr):
    query_tile = tl.program_id(0)
    part = tl.program_id(1)
    tiles_per_seq = tl.cdiv(S, TQ)
    b = query_tile // tiles_per_seq
    t0 = (query_tile % tiles_per_seq) * TQ
    t = t0 + tl.arange(0, TQ)
    live_t = t < S
    tok = b * S + t
    q, w = _load_queries(q_ptr, w_ptr, b * S + t0, S - t0, H, HP, D, TQ)
    visible = tl.load(visible_ptr + tok, mask=live_t, other=0)
    reach = tl.minimum(tl.max(visible), num_rows)  # no query of the tile sees a row at or past this
    keys_base = keys_ptr + b.to(tl.int64) * keys_sb
    out_rows = out_ptr + tok.to(tl.int64)[:, None] * num_rows
    n = tl.arange(0, BLOCK_N)
    for i in range(0, tiles_per_program):
        j0 = (part * tiles_per_program + i) * BLOCK_N
        j = j0 + n
        if j0 < reach:
            k = _load_keys(keys_base, j, keys_sr, j < reach, D, MXFP4)
            score = _index_scores(q, w, k, TQ, HP, FP32_DOT)
            score = tl.where(j[None, :] < visible[:, None], score, float("-inf"))
        else:  # beyond every query's visible rows: -inf without reading the keys
            score = tl.full((TQ, BLOCK_N), float("-inf"), tl.float32)
        tl.store(out_rows + j[None, :], score.to(tl.bfloat16), mask=live_t[:, None] & (j < num_rows)[None, :])


@triton.jit
def _candidate_scores_kernel(q_ptr, w_ptr, keys_ptr, blocks_ptr, visible_ptr, out_ptr, S, NB, tiles_per_program,
                             keys_sb, keys_sr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                             BLOCK_C: tl.constexpr, MXFP4: tl.constexpr, FP32_DOT: tl.constexpr):
    tok = tl.program_id(0)
    part = tl.program_id(1)
    b = tok // S
    q, w = _load_queries(q_ptr, w_ptr, tok, 1, H, HP, D, 1)
    visible = tl.load(visible_ptr + tok)
    keys_base = keys_ptr + b.to(tl.int64) * keys_sb
    for i in range(0, tiles_per_program):
        c = (part * tiles_per_program + i) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_range = c < NB * BS
        block = tl.load(blocks_ptr + tok.to(tl.int64) * NB + c // BS, mask=in_range, other=-1)
        row = block * BS + c % BS
        ok = (block >= 0) & (row < visible)
        k = _load_keys(keys_base, row, keys_sr, ok, D, MXFP4)
        score = tl.reshape(_index_scores(q, w, k, 1, HP, FP32_DOT), (BLOCK_C,))
        score = tl.where(ok, score, float("-inf"))
        tl.store(out_ptr + tok.to(tl.int64) * NB * BS + c, score.to(tl.bfloat16), mask=in_range)


@triton.jit
def _block_max_kernel(scores_ptr, visible_ptr, out_ptr, width, n_blocks, BS: tl.constexpr, BS_P2: tl.constexpr,
                      BLOCK_B: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    e = tl.arange(0, BS_P2)
    col = blk[:, None] * BS + e[None, :]
    v = tl.load(scores_ptr + row.to(tl.int64) * width + col, mask=(e < BS)[None, :] & (col < width),
                other=float("-inf")).to(tl.float32)
    best = tl.max(v, axis=1)
    visible = tl.load(visible_ptr + row)
    newest = tl.where(visible > 0, (visible - 1) // BS, -1)  # no visible row: no block pinned
    best = tl.where(blk == newest, float("inf"), best)
    tl.store(out_ptr + row.to(tl.int64) * n_blocks + blk, best, mask=blk < n_blocks)


def _check_scoring_inputs(name, q, weights, keys, fmt):
    if fmt not in FORMATS:
        raise ValueError(f"{name}: keys format {fmt!r} is not one of {FORMATS}")
    if q.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16:
        raise TypeError(f"{name}: q and weights must be bf16, got {q.dtype} and {weights.dtype}")
    dim = q.shape[-1]
    if dim < 32 or dim & (dim - 1):
        raise ValueError(f"{name}: head dim {dim} must be a power of two >= 32")
    want = (torch.bfloat16, dim) if fmt == "bf16" else (torch.uint8, dim // 2 + dim // 32)
    if (keys.dtype, keys.shape[-1]) != want or keys.stride(-1) != 1:
        raise ValueError(f"{name}: {fmt} keys must be {want[0]} rows of {want[1]} (last dim contiguous), got "
                         f"{keys.dtype} {tuple(keys.shape)} with strides {keys.stride()}")


def _tiles_per_program(query_tiles: int, key_tiles: int, device) -> int:
    """Key tiles one program walks: q is loaded once per program, so with many query tiles each program
    takes a long run of key tiles, keeping about 16 programs per SM."""
    return max(1, query_tiles * key_tiles // (16 * _num_sms(device)))


def _padded_heads(heads: int) -> int:
    return max(16, triton.next_power_of_2(heads))


def indexer_scores_triton(q, weights, keys, visible, num_rows, fmt, tokens_per_tile=None, tiles_per_program=None):
    """`dsflash::indexer_scores` on the GPU: q [B, S, H, D] bf16; weights [B, S, H] bf16; keys [B', R, D]
    bf16 or mxfp4 records [B', R, D/2 + D/32] (R >= num_rows); visible [B, S]. Returns bf16
    [B, S, num_rows]. tokens_per_tile and tiles_per_program override TQ and the key tiles per program."""
    _check_scoring_inputs("indexer_scores_triton", q, weights, keys, fmt)
    batch, seq, heads, dim = q.shape
    out = q.new_empty(batch, seq, num_rows)
    if out.numel() == 0:
        return out
    hp = _padded_heads(heads)
    tq = tokens_per_tile or (1 if seq == 1 else min(DENSE_TOKENS, triton.next_power_of_2(seq)))
    query_tiles = batch * triton.cdiv(seq, tq)
    key_tiles = triton.cdiv(num_rows, BLOCK_N)
    per = tiles_per_program or _tiles_per_program(query_tiles, key_tiles, q.device)
    _dense_scores_kernel[(query_tiles, triton.cdiv(key_tiles, per))](
        q.contiguous(), weights.contiguous(), keys, visible.contiguous(), out, seq, num_rows, per,
        keys.stride(0), keys.stride(1), H=heads, HP=hp, D=dim, TQ=tq, BLOCK_N=BLOCK_N, MXFP4=fmt == "mxfp4",
        FP32_DOT=q.device.type != "cuda", num_warps=4 if tq * hp <= 64 else 8)
    return out


def candidate_scores_triton(q, weights, keys, blocks, block_size, visible, fmt, tiles_per_program=None):
    """`dsflash::candidate_scores` on the GPU: q [B, S, H, D] bf16; weights [B, S, H] bf16; keys [B', R, D]
    bf16 or mxfp4 records [B', R, D/2 + D/32]; blocks [B, S, nb] int (-1 none); visible [B, S]. Returns
    bf16 [B, S, nb * block_size]. tiles_per_program overrides the column tiles per program."""
    _check_scoring_inputs("candidate_scores_triton", q, weights, keys, fmt)
    batch, seq, heads, dim = q.shape
    nb = blocks.shape[-1]
    out = q.new_empty(batch, seq, nb * block_size)
    if out.numel() == 0:
        return out
    tiles = triton.cdiv(nb * block_size, BLOCK_C)
    per = tiles_per_program or _tiles_per_program(batch * seq, tiles, q.device)
    _candidate_scores_kernel[(batch * seq, triton.cdiv(tiles, per))](
        q.contiguous(), weights.contiguous(), keys, blocks.contiguous(),
        visible.contiguous(), out, seq, nb, per, keys.stride(0), keys.stride(1),
        H=heads, HP=_padded_heads(heads), D=dim, BS=block_size, BLOCK_C=BLOCK_C, MXFP4=fmt == "mxfp4",
        FP32_DOT=q.device.type != "cuda")
    return out


def candidate_blocks_triton(scores, visible, topk_blocks, block_size, split=None, block=None):
    """`dsflash::candidate_blocks` on the GPU: block maxima (newest block pinned) here, then the radix
    top-k (split/block: its overrides). Returns int32 [B, S, min(topk_blocks, blocks)]."""
    width = scores.shape[-1]
    n_blocks = triton.cdiv(width, block_size)
    rows = scores.shape[:-1].numel()
    block_scores = scores.new_empty(rows, n_blocks)
    if block_scores.numel():
        _block_max_kernel[(rows, triton.cdiv(n_blocks, BLOCK_B))](
            scores.contiguous(), visible.contiguous(), block_scores, width, n_blocks, BS=block_size,
            BS_P2=triton.next_power_of_2(block_size), BLOCK_B=BLOCK_B)
    k = min(topk_blocks, n_blocks)
    picks = top_blocks_triton(block_scores, k, split, block)
    return picks.view(*scores.shape[:-1], k)
