"""Triton kernel of the full mHC seam for many tokens (prefill chunks, batched decode); mhc_triton.py's
`mhc_seam_triton` launches it from mhc.ROWS_MIN_TOKENS tokens (see mhc.py for the math and the sweep).

Grid: (block of BLOCK_T tokens, split of D). A program walks its split's columns in BLOCK_D chunks for its
block's tokens, and within a chunk the hc new streams j: with HAS_POST it expands the chunk's streams tile
[BLOCK_T, hc, BLOCK_D] into Y_j = post_j out + sum_i comb[i, j] X_i (stored bf16; the sums go on with the
bf16 values), else Y_j is stream j as loaded; then
  - the 24 mix dot products as a matmul: acc [BLOCK_T, MIX_PAD] += tl.dot(Y_j [BLOCK_T, BLOCK_D],
    fn^T [BLOCK_D, MIX_PAD]) over fn's columns j D + d, its 24 rows padded with zeros (tl.dot needs 16 or
    more rows and columns, hence BLOCK_T >= 16). One dot per stream: one dot over the chunk's hc BLOCK_D
    values took 238 registers instead of 142 at the default launch (sm_90) and spilled with tf32x3.
    PRECISION: "tf32x3" by default (tensor cores; fn in two TF32 parts, the bf16 streams exact in TF32),
    "ieee" (fp32 FMAs) for comparison; TF32 alone would lose the reference's fp32 accuracy;
  - the streams' sum of squares and the collapse sum_j pre_lag_j Y_j, rounded to bf16 into `normed` after
    the chunk's last stream, its sum of squares too.
The fn tile is read once per chunk for all the block's tokens, which the one-token programs of mhc_triton.py
cannot share; Triton pipelines the chunks' loads (num_stages, 16-byte aligned tensors). Then the block's
mixes are finished in registers, vectorised over its tokens (rms, sigmoids, the Sinkhorn rounds on
[BLOCK_T, hc, hc]), and a second pass over D normalises the block's collapsed rows in place
(w * (x * rstd), bf16), with the helpers of mhc_finish_triton.py that mhc_triton.py's `_finish_token` calls.

The D split: one program's serial walk over all of D takes ~220 us on the H200 (80 chunks of 64), so a few
token blocks leave most SMs idle. With more than one split each program stores its partial [BLOCK_T, MIX_PAD]
(mix dots and the two sums of squares) and bumps its block's counter (block_counters.py, lane "main"); the
last program of the block adds the partials in split order (deterministic), finishes as above and resets the
counter. The splits come from the shapes only (split_plan: about TARGET_PROGRAMS programs), so the launch is
CUDA-graph safe; one split is the kernel without partials or counters.

Rounding points are the reference's: fp32 math, bf16 casts of the new streams and of the collapse. Only the
order of the fp32 sums differs from the one-token kernel (and between split counts), so they agree within
summation order, not bit for bit: the split launches of mhc_split.py keep mhc_triton.py's kernel (they must
equal its one launch), and the overlap pass splits only seams of at most
CompileOptions.mhc_overlap_max_tokens (16) tokens, fewer than mhc.ROWS_MIN_TOKENS.
"""

import torch
import triton
import triton.language as tl

from .block_counters import block_counters
from .mhc_finish_triton import _mixes, _rms_norm

# The fastest launch at every count swept; TF32x3 on tensor cores is 2.7-3.5x faster than "ieee" (fp32 FMAs)
# and agreed with the reference as closely (the sweep's check). splits: D splits per token block; None:
# split_plan's (about TARGET_PROGRAMS programs), within 10% of the best swept split at every count
LAUNCH = dict(block_t=16, block_d=64, num_warps=4, precision="tf32x3", splits=None)
# Two programs per SM of an H200 (132 SMs), all resident at once: the default launch takes 255 registers a
# thread and 95 KB of shared memory (sm_90 compile); two programs of a block per SM ran 1.3x the throughput
# of one (4096 tokens = 256 programs in 359 us, 1024 = 64 programs in 233)
TARGET_PROGRAMS = 264
SPLIT_GROUP = tl.constexpr(8)  # partials the finishing program adds per load: [8, BLOCK_T, MIX_PAD] tiles
# values per tile of the finishing program's normalisation pass with a split: 16 x 256 at the default launch
# (16 x 512 took 168 registers instead of 128 without HAS_POST)
NORM_TILE = 4096


@triton.jit
def _seam_rows_kernel(out_ptr, streams_ptr, post_ptr, comb_ptr, pre_lag_ptr, fn_ptr, scale_ptr, base_ptr, weight_ptr,
                      new_streams_ptr, normed_ptr, pre_out_ptr, post_out_ptr, comb_out_ptr, partial_ptr, counter_ptr,
                      N, span, norm_eps, hc_eps, iters,
                      HC: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                      MIX_PAD: tl.constexpr, NORM_D: tl.constexpr, HAS_POST: tl.constexpr, PRECISION: tl.constexpr,
                      SPLIT: tl.constexpr):
    MIX: tl.constexpr = (2 + HC) * HC
    block = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    t = tl.arange(0, BLOCK_T)
    token = block * BLOCK_T + t
    live = token < N
    row = token.to(tl.int64)
    i = tl.arange(0, HC)
    m = tl.arange(0, MIX_PAD)
    fn_rows = fn_ptr + m[None, :] * (HC * D)

    acc = tl.zeros((BLOCK_T, MIX_PAD), dtype=tl.float32)
    streams_ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    collapse_ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    lo, hi = 0, D  # one split: constant bounds (runtime ones took 128 -> 168 registers without HAS_POST)
    if SPLIT:
        lo = split * span
        hi = tl.minimum(lo + span, D)
    for d0 in range(lo, hi, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        rows_d = live[:, None] & (d < D)[None, :]
        if HAS_POST:
            x = tl.load(streams_ptr + row[:, None, None] * (HC * D) + i[None, :, None] * D + d[None, None, :],
                        mask=rows_d[:, None, :], other=0.0).to(tl.float32)
            o = tl.load(out_ptr + row[:, None] * D + d[None, :], mask=rows_d, other=0.0).to(tl.float32)
        collapsed = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        # one new stream j at a time: a dot over BLOCK_D values keeps its operands small in registers
        for j in tl.static_range(HC):
            sd = row[:, None] * (HC * D) + j * D + d[None, :]
            if HAS_POST:  # Y_j = post_j * out + sum_i comb[i, j] X_i, rounded to bf16
                q = tl.load(post_ptr + row * HC + j, mask=live, other=0.0)
                c = tl.load(comb_ptr + row[:, None] * (HC * HC) + i[None, :] * HC + j, mask=live[:, None], other=0.0)
                y = (q[:, None] * o + tl.sum(c[:, :, None] * x, axis=1)).to(tl.bfloat16)
                tl.store(new_streams_ptr + sd, y, mask=rows_d)
            else:
                y = tl.load(streams_ptr + sd, mask=rows_d, other=0.0)
            fn = tl.load(fn_rows + j * D + d[:, None], mask=(m < MIX)[None, :] & (d < D)[:, None], other=0.0)
            y = y.to(tl.float32)
            acc = tl.dot(y, fn, acc, input_precision=PRECISION)
            streams_ss += tl.sum(y * y, axis=1)
            collapsed += tl.load(pre_lag_ptr + row * HC + j, mask=live, other=0.0)[:, None] * y
        collapsed = collapsed.to(tl.bfloat16)
        tl.store(normed_ptr + row[:, None] * D + d[None, :], collapsed, mask=rows_d)
        cf = collapsed.to(tl.float32)
        collapse_ss += tl.sum(cf * cf, axis=1)

    if SPLIT:
        # the partial [BLOCK_T, MIX_PAD]: the mix dots, the sums of squares in columns MIX and MIX + 1 (zero in
        # acc: fn's padding rows)
        tile = t[:, None] * MIX_PAD + m[None, :]
        part = tl.where(m[None, :] == MIX, streams_ss[:, None], tl.where(m[None, :] == MIX + 1, collapse_ss[:, None],
                                                                           acc))
        tl.store(partial_ptr + (block * splits + split) * (BLOCK_T * MIX_PAD) + tile, part)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        if tl.atomic_add(counter_ptr + block, 1, sem="acq_rel") == splits - 1:
            s = tl.arange(0, SPLIT_GROUP)
            acc = tl.zeros((BLOCK_T, MIX_PAD), dtype=tl.float32)
            # in split order (groups of SPLIT_GROUP): the same bits whichever program finishes; .cg: bypass L1
            # (not coherent across SMs) to read what the other programs wrote
            for s0 in range(0, splits, SPLIT_GROUP):
                parts = tl.load(partial_ptr + (block * splits + s0 + s)[:, None, None] * (BLOCK_T * MIX_PAD) + tile,
                                mask=(s0 + s < splits)[:, None, None], other=0.0, cache_modifier=".cg")
                acc += tl.sum(parts, axis=0)
            streams_ss = tl.sum(tl.where(m[None, :] == MIX, acc, 0.0), axis=1)
            collapse_ss = tl.sum(tl.where(m[None, :] == MIX + 1, acc, 0.0), axis=1)
            _finish_rows(acc, streams_ss, collapse_ss, row, live, scale_ptr, base_ptr, weight_ptr, normed_ptr,
                         pre_out_ptr, post_out_ptr, comb_out_ptr, norm_eps, hc_eps, iters, HC, D, MIX_PAD, NORM_D)
            tl.atomic_xchg(counter_ptr + block, 0)
    else:
        tl.debug_barrier()  # the collapsed rows _finish_rows reads were stored by other threads of this program
        _finish_rows(acc, streams_ss, collapse_ss, row, live, scale_ptr, base_ptr, weight_ptr, normed_ptr,
                     pre_out_ptr, post_out_ptr, comb_out_ptr, norm_eps, hc_eps, iters, HC, D, MIX_PAD, NORM_D)


@triton.jit
def _finish_rows(acc, streams_ss, collapse_ss, row, live, scale_ptr, base_ptr, weight_ptr, normed_ptr, pre_out_ptr,
                 post_out_ptr, comb_out_ptr, norm_eps, hc_eps, iters, HC: tl.constexpr, D: tl.constexpr,
                 MIX_PAD: tl.constexpr, NORM_D: tl.constexpr):
    """A block's mixes from its dot products acc [BLOCK_T, MIX_PAD] and its sums of squares, vectorised over
    its tokens (mhc_finish_triton.py's `_mixes` on [BLOCK_T, hc, hc]); then its collapsed rows normalised in
    place (`_rms_norm`), NORM_D columns at a time: the math of mhc_triton.py's `_finish_token`."""
    i = tl.arange(0, HC)
    m = tl.arange(0, MIX_PAD)
    # the dot's columns as [tokens, hc] and [tokens, hc, hc]: a sum with one nonzero term, exact
    ab = 2 * HC + i[:, None] * HC + i[None, :]
    pre_dot = tl.sum(tl.where(m[None, None, :] == i[None, :, None], acc[:, None, :], 0.0), axis=2)
    post_dot = tl.sum(tl.where(m[None, None, :] == HC + i[None, :, None], acc[:, None, :], 0.0), axis=2)
    comb_dot = tl.sum(tl.where(m[None, None, None, :] == ab[None, :, :, None], acc[:, None, None, :], 0.0), axis=3)
    pre, post, comb = _mixes(pre_dot, post_dot, comb_dot, streams_ss, scale_ptr, base_ptr, norm_eps, hc_eps, iters,
                             HC, D)
    mix_rows = row[:, None] * HC + i[None, :]
    tl.store(pre_out_ptr + mix_rows, pre, mask=live[:, None])
    tl.store(post_out_ptr + mix_rows, post, mask=live[:, None])
    tl.store(comb_out_ptr + mix_rows[:, :, None] * HC + i[None, None, :], comb, mask=live[:, None, None])

    for d0 in tl.range(0, D, NORM_D, num_stages=3):  # pipelined loads, as in the D loop (with no dot, not by default)
        d = d0 + tl.arange(0, NORM_D)
        nd = normed_ptr + row[:, None] * D + d[None, :]
        mask = live[:, None] & (d < D)[None, :]
        # .cg: with a split, other programs (other SMs) stored most of these rows
        x = tl.load(nd, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        w = tl.load(weight_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(nd, _rms_norm(x, w, collapse_ss, norm_eps, D), mask=mask)


def split_plan(tokens: int, dim: int, launch: dict) -> tuple[int, int, int]:
    """(token blocks, D splits, columns per split) of a launch (LAUNCH's keys), from the shapes only (no host
    sync, CUDA-graph safe). splits=None brings the blocks up to about TARGET_PROGRAMS programs; each split
    takes whole BLOCK_D chunks and none is left without columns (so asking for 64 splits of 80 chunks gives 40)."""
    blocks = triton.cdiv(tokens, launch["block_t"])
    chunks = triton.cdiv(dim, launch["block_d"])
    wanted = launch["splits"] or max(1, TARGET_PROGRAMS // blocks)
    per_split = triton.cdiv(chunks, min(wanted, chunks))
    return blocks, triton.cdiv(chunks, per_split), per_split * launch["block_d"]


def seam_rows(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight, new_streams, normed, pre_out,
              post_out, comb_out, norm_eps, hc_eps, iters, has_post, launch=None):
    """One launch over contiguous flat tensors (streams [tokens, hc, D], the others to match; without has_post
    out/post/comb are placeholders) writing new_streams (with has_post), normed, pre_out, post_out, comb_out.
    launch: overrides of LAUNCH (scripts/sweep_mhc.py)."""
    unknown = set(launch or {}) - set(LAUNCH)
    if unknown:
        raise ValueError(f"mhc seam rows kernel: unknown launch keys {sorted(unknown)}, expected {sorted(LAUNCH)}")
    launch = {**LAUNCH, **(launch or {})}
    block_t, block_d = launch["block_t"], launch["block_d"]
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"mhc seam rows kernel: block_t={block_t}; tl.dot needs a power of 2 of at least 16 rows")
    tokens, hc, dim = streams.shape
    blocks, splits, span = split_plan(tokens, dim, launch)
    mix_pad = max(16, triton.next_power_of_2((2 + hc) * hc + 2))  # room for the partials' two sums of squares
    partial, counters, norm_d = normed, normed, block_d  # one split: no partials, no counters
    if splits > 1:
        partial = normed.new_empty(blocks * splits * block_t * mix_pad, dtype=torch.float32)
        counters = block_counters(normed.device, blocks)
        # the finishing program normalises its block's rows alone: wider tiles, more loads in flight
        norm_d = min(triton.next_power_of_2(dim), max(block_d, NORM_TILE // block_t))
    _seam_rows_kernel[(blocks, splits)](
        out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight, new_streams, normed, pre_out, post_out,
        comb_out, partial, counters, tokens, span, norm_eps, hc_eps, iters, HC=hc, D=dim, BLOCK_T=block_t,
        BLOCK_D=block_d, MIX_PAD=mix_pad, NORM_D=norm_d, HAS_POST=has_post, PRECISION=launch["precision"],
        SPLIT=splits > 1, num_warps=launch["num_warps"])
