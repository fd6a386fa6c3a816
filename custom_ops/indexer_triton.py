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
             columns name; scores [tokens, nb * bs] instead of [tokens, context]. The decode path.
  union      the prefill path of candidate_scores (>= UNION_MIN_TOKENS tokens per sequence). Grid (group
             of TQ consecutive tokens of one sequence, part of the group's block-id range). Neighbouring
             tokens share most of their candidate blocks (layer 20's top-2048 of close queries), so the
             per-token kernel decoded the same MXFP4 rows TQ times and ran M = 32 dots. Here a program
             merges the TQ ascending block lists on the fly into their union, NU blocks (NU x bs key
             rows) per step, decodes those rows once and scores them for all TQ tokens in one
             tensor-core dot of M = TQ x heads (64 at the release, TQ = 2), then writes each token's scores
             to the columns where its own list holds those blocks (a block a token lacks is computed
             and not stored). Work per group ~ |union|, between one token's list (identical lists) and
             TQ lists (disjoint: then no worse in decodes than the per-token kernel, only TQ x the
             tensor-core work, which is not the limit). The merge step: load the next NU entries of
             every list from its cursor ([TQ, NU]); the NU smallest distinct values among them are the
             union's next NU (a list's later entries are larger than its first NU); ranks of distinct
             values by [TQ*NU, TQ*NU] comparisons; cursors advance past the last value taken; a token's
             column for union block u is its cursor + the position of u among its loaded entries. The
             range is split between programs at the group's first token's list (parts x its entries),
             so a program's cursors start at a lower bound found while it checks the lists. The lists
             must be what candidate_blocks publishes (strictly ascending ids, then -1s); every program
             checks its group's lists and, if one is not, scores that group column by column like the
             per-token kernel (same results, no host sync). Columns of -1 blocks are written -inf.
  block max  grid (query token, tile of blocks): max over each block of bs scores, +inf for the block
             of the newest visible row; the top-k of candidate_blocks then runs on these (topk_triton).
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot, _e2m1_rows, _num_sms, _ue8m0_f32
from .pdl import launch_options, pdl_wait
from .topk_triton import top_blocks_triton

BLOCK_C = 32  # candidate columns per tile
BLOCK_N = 64  # dense: keys per tile
BLOCK_B = 128  # block max: blocks per program
DENSE_TOKENS = 4  # dense prefill: query tokens sharing a key tile
FORMATS = ("bf16", "mxfp4")
# union path launch, from scripts/sweep_union.py on the H200 (union-sweep-2026-11-30.json): 2 tokens x 4
# blocks (M = 2 x 32 heads = 64, one wgmma tile; N = 4 x 8 rows = 32) with 4 programs per group took
# 10.4 / 11.2 ms at 128K / 512K against 16.0 / 18.2 ms for 4 x 8 with one: smaller unions waste fewer
# rows on blocks only one token of the group needs
UNION_TOKENS = 2  # query tokens per group
UNION_BLOCKS = 4  # union blocks per step
UNION_PARTS = 4  # programs per group (at least; more when the groups alone do not fill the GPU)
UNION_MIN_TOKENS = 4  # fewer tokens per sequence (decode, short speculative chunks): the per-token kernel
# (it has more programs per token, and a group would be mostly padding on the M side)
SCAN = 512  # union path: list entries per step of the check


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
        scale = _ue8m0_f32(exps)[:, :, None]
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
                         BLOCK_N: tl.constexpr, MXFP4: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
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
def _candidate_tile(q, w, keys_base, keys_sr, blocks_row, out_row, visible, c, NB, BS: tl.constexpr,
                    D: tl.constexpr, HP: tl.constexpr, MXFP4: tl.constexpr, FP32_DOT: tl.constexpr):
    """One token's candidate columns c (the per-token kernels' tile): gather, score, store."""
    in_range = c < NB * BS
    block = tl.load(blocks_row + c // BS, mask=in_range, other=-1)
    row = block * BS + c % BS
    ok = (block >= 0) & (row < visible)
    k = _load_keys(keys_base, row, keys_sr, ok, D, MXFP4)
    score = tl.reshape(_index_scores(q, w, k, 1, HP, FP32_DOT), (c.shape[0],))
    score = tl.where(ok, score, float("-inf"))
    tl.store(out_row + c, score.to(tl.bfloat16), mask=in_range)


@triton.jit
def _candidate_scores_kernel(q_ptr, w_ptr, keys_ptr, blocks_ptr, visible_ptr, out_ptr, S, NB, tiles_per_program,
                             keys_sb, keys_sr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                             BLOCK_C: tl.constexpr, MXFP4: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    tok = tl.program_id(0)
    part = tl.program_id(1)
    b = tok // S
    q, w = _load_queries(q_ptr, w_ptr, tok, 1, H, HP, D, 1)
    visible = tl.load(visible_ptr + tok)
    keys_base = keys_ptr + b.to(tl.int64) * keys_sb
    out_row = out_ptr + tok.to(tl.int64) * NB * BS
    for i in range(0, tiles_per_program):
        c = (part * tiles_per_program + i) * BLOCK_C + tl.arange(0, BLOCK_C)
        _candidate_tile(q, w, keys_base, keys_sr, blocks_ptr + tok.to(tl.int64) * NB, out_row, visible, c, NB, BS, D,
                        HP, MXFP4, FP32_DOT)


@triton.jit
def _candidate_union_kernel(q_ptr, w_ptr, keys_ptr, blocks_ptr, visible_ptr, out_ptr, S, NB, parts, keys_sb,
                            keys_sr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                            TQ: tl.constexpr, NU: tl.constexpr, SCAN: tl.constexpr, BLOCK_C: tl.constexpr,
                            MXFP4: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    BIG: tl.constexpr = 2147483647  # no block (-1 entries, past the list or past this program's range)
    N: tl.constexpr = NU * BS
    group = tl.program_id(0)
    part = tl.program_id(1)
    groups_per_seq = tl.cdiv(S, TQ)
    b = group // groups_per_seq
    t0 = (group % groups_per_seq) * TQ
    tq = tl.arange(0, TQ)
    live_t = t0 + tq < S
    tok = b * S + t0 + tq
    visible = tl.load(visible_ptr + tok, mask=live_t, other=0)
    lists = blocks_ptr + tok.to(tl.int64) * NB  # [TQ]
    out_rows = out_ptr + tok.to(tl.int64) * NB * BS
    keys_base = keys_ptr + b.to(tl.int64) * keys_sb
    # this program's block ids [lo, hi): split at entries part * W, (part + 1) * W of the first token's list
    W = tl.cdiv(NB, parts)
    lo_pos = part * W
    hi_pos = lo_pos + W
    lead = blocks_ptr + (b * S + t0).to(tl.int64) * NB
    lo = tl.load(lead + lo_pos, mask=lo_pos < NB, other=-1)
    lo = tl.where(part == 0, 0, tl.where(lo >= 0, lo, BIG))
    hi = tl.load(lead + hi_pos, mask=hi_pos < NB, other=-1)
    hi = tl.where(hi >= 0, hi, BIG)
    # check the lists (strictly ascending ids, then only negatives); cursors at the lower bound of lo
    bad = tl.zeros((TQ,), tl.int32)
    cur = tl.zeros((TQ,), tl.int32)
    n_valid = tl.zeros((TQ,), tl.int32)
    e_i = tl.arange(0, SCAN)
    for c0 in range(0, NB, SCAN):
        pos = c0 + e_i
        m = live_t[:, None] & (pos < NB)[None, :]
        e = tl.load(lists[:, None] + pos[None, :], mask=m, other=-1)
        prev = tl.load(lists[:, None] + pos[None, :] - 1, mask=m & (pos >= 1)[None, :], other=-1)
        wrong = (e >= 0) & (pos >= 1)[None, :] & ((prev < 0) | (prev >= e))
        bad += tl.sum(wrong.to(tl.int32), axis=1)
        cur += tl.sum(((e >= 0) & (e < lo)).to(tl.int32), axis=1)
        n_valid += tl.sum((e >= 0).to(tl.int32), axis=1)
    if tl.sum(bad) > 0:  # not candidate_blocks' layout: this program's columns one token at a time
        for i in tl.static_range(TQ):
            if t0 + i < S:
                qi, wi = _load_queries(q_ptr, w_ptr, b * S + t0 + i, 1, H, HP, D, 1)
                vis_i = tl.load(visible_ptr + b * S + t0 + i)
                row_i = (b * S + t0 + i).to(tl.int64)
                for c1 in range(lo_pos * BS, tl.minimum(hi_pos, NB) * BS, BLOCK_C):
                    c = c1 + tl.arange(0, BLOCK_C)
                    c = tl.where(c < hi_pos * BS, c, NB * BS)  # (past this program's share: not stored)
                    _candidate_tile(qi, wi, keys_base, keys_sr, blocks_ptr + row_i * NB, out_ptr + row_i * NB * BS,
                                    vis_i, c, NB, BS, D, HP, MXFP4, FP32_DOT)
    else:
        q, w = _load_queries(q_ptr, w_ptr, b * S + t0, S - t0, H, HP, D, TQ)
        reach = tl.max(visible)  # rows at or past it are not visible to any token of the group
        i_u = tl.arange(0, NU)
        flat_t = tl.arange(0, TQ * NU) // NU
        n = tl.arange(0, N)
        more = tl.full((), 1, tl.int32)
        while more > 0:
            v = tl.load(lists[:, None] + cur[:, None] + i_u[None, :],
                        mask=live_t[:, None] & ((cur[:, None] + i_u[None, :]) < NB), other=-1)
            v = tl.where((v >= 0) & (v < hi), v, BIG)  # [TQ, NU], ascending per token
            flat = tl.reshape(v, (TQ * NU,))
            same = flat[:, None] == flat[None, :]
            dup = tl.sum((same & (flat_t[None, :] < flat_t[:, None])).to(tl.int32), axis=1) > 0
            first = (~dup) & (flat < BIG)  # one element per distinct value
            rank = tl.sum(((flat[None, :] < flat[:, None]) & first[None, :]).to(tl.int32), axis=1)
            take = first & (rank < NU)
            n_u = tl.sum(take.to(tl.int32))
            u = tl.max(tl.where(take[None, :] & (rank[None, :] == i_u[:, None]), flat[None, :], -1), axis=1)  # [NU]
            last = tl.max(u)
            if n_u > 0:
                hit = (v[:, None, :] == u[None, :, None]) & (u >= 0)[None, :, None]  # [TQ, NU (union), NU (list)]
                present = tl.max(hit.to(tl.int32), axis=2)
                col = cur[:, None] + tl.sum(tl.where(hit, i_u[None, None, :], 0), axis=2)  # [TQ, NU]
                # Rows u * BS + j are summed in 2-D before the reshape: summed after it, Triton's alignment
                # analysis lost the runs of BS and took every row as a multiple of BS, so it read the 68 B
                # MXFP4 records in 8-byte vectors (misaligned address on the H200).
                row = tl.reshape(u[:, None] * BS + tl.arange(0, BS)[None, :], (N,))
                k = _load_keys(keys_base, row, keys_sr, (row >= 0) & (row < reach), D, MXFP4)
                score = _index_scores(q, w, k, TQ, HP, FP32_DOT)  # [TQ, N]
                score = tl.where(row[None, :] < visible[:, None], score, float("-inf"))
                col_n = tl.reshape(col[:, :, None] * BS + tl.arange(0, BS)[None, None, :], (TQ, N))
                keep = tl.reshape(tl.broadcast_to(present[:, :, None], (TQ, NU, BS)), (TQ, N)) > 0
                tl.store(out_rows[:, None] + col_n, score.to(tl.bfloat16), mask=keep & live_t[:, None])
            cur += tl.sum(((v <= last) & (v < BIG)).to(tl.int32), axis=1)
            more = (n_u == NU).to(tl.int32)
        if part == parts - 1:  # the columns of -1 blocks (after each list's valid entries)
            start = tl.min(tl.where(live_t, n_valid, NB)) * BS
            for c1 in range(start, NB * BS, BLOCK_C * 8):
                c = c1 + tl.arange(0, BLOCK_C * 8)
                tl.store(out_rows[:, None] + c[None, :], tl.full((TQ, BLOCK_C * 8), float("-inf"), tl.float32).to(tl.bfloat16),
                         mask=live_t[:, None] & (c[None, :] >= n_valid[:, None] * BS) & (c < NB * BS)[None, :])


@triton.jit
def _block_max_kernel(scores_ptr, visible_ptr, out_ptr, width, n_blocks, BS: tl.constexpr, BS_P2: tl.constexpr,
                      BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
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
        FP32_DOT=q.device.type != "cuda", num_warps=4 if tq * hp <= 64 else 8, **launch_options(q.device))
    return out


def union_fits(seq: int, block_size: int) -> bool:
    """The prefill path's choice (shapes only): a full group of tokens per sequence, and power-of-two
    blocks (the union tile is NU x block_size key rows). Record loads must stay 4-byte: row ids are summed
    before any reshape, so alignment analysis cannot assume 8-row multiples (an H200 fault once came from
    8-byte reads of 68 B records; test_mxfp4_records_are_read_at_their_alignment guards it)."""
    return seq >= UNION_MIN_TOKENS and block_size & (block_size - 1) == 0


def candidate_scores_triton(q, weights, keys, blocks, block_size, visible, fmt, tiles_per_program=None,
                            union=None, tokens_per_group=UNION_TOKENS, union_blocks=UNION_BLOCKS, parts=None):
    """`dsflash::candidate_scores` on the GPU: q [B, S, H, D] bf16; weights [B, S, H] bf16; keys [B', R, D]
    bf16 or mxfp4 records [B', R, D/2 + D/32]; blocks [B, S, nb] int (-1 none); visible [B, S]. Returns
    bf16 [B, S, nb * block_size]. union: force (True) or refuse (False) the prefill path (None: union_fits);
    tiles_per_program (per-token path), tokens_per_group, union_blocks and parts (union path: programs
    per group) override the defaults."""
    _check_scoring_inputs("candidate_scores_triton", q, weights, keys, fmt)
    batch, seq, heads, dim = q.shape
    nb = blocks.shape[-1]
    out = q.new_empty(batch, seq, nb * block_size)
    if out.numel() == 0:
        return out
    if union or (union is None and union_fits(seq, block_size)):
        groups = batch * triton.cdiv(seq, tokens_per_group)
        wanted = max(UNION_PARTS, triton.cdiv(2 * _num_sms(q.device), groups))
        parts = parts or max(1, min(wanted, nb // (4 * union_blocks)))
        hp = _padded_heads(heads)
        _candidate_union_kernel[(groups, parts)](
            q.contiguous(), weights.contiguous(), keys, blocks.contiguous(), visible.contiguous(), out, seq, nb, parts,
            keys.stride(0), keys.stride(1), H=heads, HP=hp, D=dim, BS=block_size, TQ=tokens_per_group, NU=union_blocks,
            SCAN=SCAN, BLOCK_C=BLOCK_C, MXFP4=fmt == "mxfp4", FP32_DOT=q.device.type != "cuda",
            num_warps=8 if tokens_per_group * hp >= 128 else 4, **launch_options(q.device))
        return out
    tiles = triton.cdiv(nb * block_size, BLOCK_C)
    per = tiles_per_program or _tiles_per_program(batch * seq, tiles, q.device)
    _candidate_scores_kernel[(batch * seq, triton.cdiv(tiles, per))](
        q.contiguous(), weights.contiguous(), keys, blocks.contiguous(),
        visible.contiguous(), out, seq, nb, per, keys.stride(0), keys.stride(1),
        H=heads, HP=_padded_heads(heads), D=dim, BS=block_size, BLOCK_C=BLOCK_C, MXFP4=fmt == "mxfp4",
        FP32_DOT=q.device.type != "cuda", **launch_options(q.device))
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
            BS_P2=triton.next_power_of_2(block_size), BLOCK_B=BLOCK_B, **launch_options(scores.device))
    k = min(topk_blocks, n_blocks)
    picks = top_blocks_triton(block_scores, k, split, block)
    return picks.view(*scores.shape[:-1], k)
