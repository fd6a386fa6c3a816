"""Triton kernels of the full mHC seam for many tokens (prefill chunks, batched decode); mhc_triton.py's
`mhc_seam_triton` launches them from mhc.ROWS_MIN_TOKENS tokens (see mhc.py for the math and the sweep).

Two launches. `_seam_rows_kernel`, grid (block of BLOCK_T tokens, split of D): a program walks its split's
columns in BLOCK_D chunks for its block's tokens, and within a chunk the hc new streams j: with HAS_POST it
expands the chunk's streams tile [BLOCK_T, hc, BLOCK_D] into Y_j = post_j out + sum_i comb[i, j] X_i (stored
bf16; the sums go on with the bf16 values), else Y_j is stream j as loaded; then
  - the 24 mix dot products as a matmul: acc [BLOCK_T, MIX_PAD] += tl.dot(Y_j [BLOCK_T, BLOCK_D],
    fn^T [BLOCK_D, MIX_PAD]) over fn's columns j D + d, its 24 rows padded with zeros (tl.dot needs 16 or
    more rows and columns, hence BLOCK_T >= 16). One dot per stream: one dot over the chunk's hc BLOCK_D
    values took 238 registers instead of 142 at the default launch (sm_90) and spilled with tf32x3.
    PRECISION: "tf32x3" by default (tensor cores; fn in two TF32 parts, the bf16 streams exact in TF32),
    "ieee" (fp32 FMAs) for comparison; TF32 alone would lose the reference's fp32 accuracy;
  - the streams' sum of squares and the collapse sum_j pre_lag_j Y_j, rounded to bf16 into `normed` after
    the chunk's last stream, its sum of squares too.
The fn tile is read once per chunk for all the block's tokens, which the one-token programs of mhc_triton.py
cannot share; Triton pipelines the chunks' loads (num_stages, 16-byte aligned tensors). Each program stores
its tokens' partials [MIX_PAD] (mix dots, the two sums of squares) for its split.

`_finish_rows_kernel`, per token: its partials added in split order (deterministic), its mixes (rms, sigmoids,
the Sinkhorn rounds) and its collapsed row normalised in place: mhc_triton.py's `_finish_token`, so every
finish runs in parallel, by default in two programs a token (the mixes beside the RMSNorm). Until 12-02
(session o) one launch did both, the block's last program finishing it (counters): at 64 tokens one program
per block then ran the Sinkhorn of 16 tokens and the RMSNorm of 16 rows of 5120 after the main pass (30.6 us
a seam in a B64 decode step).

The D split: one program's serial walk over all of D takes ~220 us on the H200 (80 chunks of 64), so a few
token blocks leave most SMs idle. The splits come from the shapes only (split_plan: about TARGET_PROGRAMS
programs), so the launch is CUDA-graph safe and needs no counters.

Rounding points are the reference's: fp32 math, bf16 casts of the new streams and of the collapse. Only the
order of the fp32 sums differs from the one-token kernel (and between split counts), so they agree within
summation order, not bit for bit: the split launches of mhc_split.py keep mhc_triton.py's kernel (they must
equal its one launch), and the overlap pass splits only seams of at most
CompileOptions.mhc_overlap_max_tokens (16) tokens, fewer than mhc.ROWS_MIN_TOKENS.
"""

import torch
import triton
import triton.language as tl

from .mhc_finish_triton import _finish_token
from .pdl import launch_options, pdl_wait

# The fastest launch at every count swept; TF32x3 on tensor cores is 2.7-3.5x faster than "ieee" (fp32 FMAs)
# and agreed with the reference as closely (the sweep's check). splits: D splits per token block; None:
# split_plan's (about TARGET_PROGRAMS programs), within 10% of the best swept split at every count.
# finish_norm_block / finish_warps: the finishing launch's RMSNorm tile and warps; one warp and the whole row in
# one tile were the fastest at 32, 64 and 128 tokens (14.6 / 18.1 / 21.8 us against 17.0 / 19.6 / 22.8 at 2048
# and 4 warps; H200 12-02 o), within the noise (~1%) at 1024 and 4096. finish_split: two programs a token, the
# mixes beside the RMSNorm: 12.5 / 16.3 / 20.8 us a seam at 32 / 64 / 128 tokens against 14.5 / 18.0 / 21.8
# (48 seams back to back in one graph, fn cold: mhc-rows-finish-split-2026-12-02-o.json)
LAUNCH = dict(block_t=16, block_d=64, num_warps=4, precision="tf32x3", splits=None, finish_norm_block=8192,
              finish_warps=1, finish_split=True)
# Two programs per SM of an H200 (132 SMs), all resident at once: the default launch took 255 registers a
# thread and 95 KB of shared memory (sm_90 compile, with the finish inside); two programs of a block per SM
# ran 1.3x the throughput of one (4096 tokens = 256 programs in 359 us, 1024 = 64 programs in 233)
TARGET_PROGRAMS = 264


@triton.jit
def _seam_rows_kernel(out_ptr, streams_ptr, post_ptr, comb_ptr, pre_lag_ptr, fn_ptr,
                      new_streams_ptr, normed_ptr, partial_ptr, N, span,
                      HC: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                      MIX_PAD: tl.constexpr, HAS_POST: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
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

    # the token's partial row [MIX_PAD]: the mix dots, the sums of squares in columns MIX and MIX + 1 (zero in acc:
    # fn's padding rows), at partial[token, split]: the layout _finish_token reads
    part = tl.where(m[None, :] == MIX, streams_ss[:, None], tl.where(m[None, :] == MIX + 1, collapse_ss[:, None], acc))
    tl.store(partial_ptr + (row[:, None] * splits + split) * MIX_PAD + m[None, :], part, mask=live[:, None])


@triton.jit
def _finish_rows_kernel(partial_ptr, scale_ptr, base_ptr, weight_ptr, normed_ptr, pre_out_ptr, post_out_ptr,
                        comb_out_ptr, splits, norm_eps, hc_eps, iters, HC: tl.constexpr, D: tl.constexpr,
                        MIX_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, NORM_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid (token, half): its partials summed over the splits, its mixes (sigmoids, Sinkhorn) and its collapsed
    row normalised in place (mhc_triton.py's finish). With one half a program does both; with two (the launch's
    finish_split) half 0 runs the mixes and half 1 the RMSNorm side by side, each computing what one program
    would: the same bits."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    half = tl.program_id(1)
    both = tl.num_programs(1) == 1
    _finish_token(tl.program_id(0).to(tl.int64), splits, partial_ptr, scale_ptr, base_ptr, weight_ptr, normed_ptr,
                  pre_out_ptr, post_out_ptr, comb_out_ptr, norm_eps, hc_eps, iters, HC, D, MIX_PAD, SPLITS_PAD,
                  NORM_BLOCK, both | (half == 0), both | (half == 1))


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
    """Two launches over contiguous flat tensors (streams [tokens, hc, D], the others to match; without has_post
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
    partial = normed.new_empty(tokens, splits, mix_pad, dtype=torch.float32)
    _seam_rows_kernel[(blocks, splits)](
        out, streams, post, comb, pre_lagged, fn, new_streams, normed, partial, tokens, span, HC=hc, D=dim,
        BLOCK_T=block_t, BLOCK_D=block_d, MIX_PAD=mix_pad, HAS_POST=has_post, PRECISION=launch["precision"],
        SPLIT=splits > 1, num_warps=launch["num_warps"], **launch_options(out.device))
    _finish_rows_kernel[(tokens, 2 if launch["finish_split"] else 1)](
        partial, scale, base, norm_weight, normed, pre_out, post_out, comb_out, splits, norm_eps, hc_eps, iters,
        HC=hc, D=dim, MIX_PAD=mix_pad, SPLITS_PAD=triton.next_power_of_2(splits),
        NORM_BLOCK=min(launch["finish_norm_block"], triton.next_power_of_2(dim)), num_warps=launch["finish_warps"],
        **launch_options(out.device))
