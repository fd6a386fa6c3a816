"""Triton kernel of the full mHC seam for many tokens (prefill chunks, batched decode); mhc_triton.py's
`mhc_seam_triton` launches it from ROWS_MIN_TOKENS tokens (see mhc.py for the math).

Grid: (block of BLOCK_T tokens,). A program owns its tokens from start to finish: no atomics, counters or
partials shared between programs. It walks D in BLOCK_D chunks, and within a chunk the hc new streams j:
with HAS_POST it expands the chunk's streams tile [BLOCK_T, hc, BLOCK_D] into Y_j = post_j out +
sum_i comb[i, j] X_i (stored bf16; the sums go on with the bf16 values), else Y_j is stream j as loaded; then
  - the 24 mix dot products as a matmul: acc [BLOCK_T, MIX_PAD] += tl.dot(Y_j [BLOCK_T, BLOCK_D],
    fn^T [BLOCK_D, MIX_PAD]) over fn's columns j D + d, its 24 rows padded with zeros (tl.dot needs 16 or
    more rows and columns, hence BLOCK_T >= 16). One dot per stream: one dot over the chunk's hc BLOCK_D
    values took 238 registers instead of 142 at the default launch (sm_90) and spilled with tf32x3.
    PRECISION: "tf32x3" by default (tensor cores; fn in two TF32 parts, the bf16 streams exact in TF32),
    "ieee" (fp32 FMAs) for comparison; TF32 alone would lose the reference's fp32 accuracy;
  - the streams' sum of squares and the collapse sum_j pre_lag_j Y_j, rounded to bf16 into `normed` after
    the chunk's last stream, its sum of squares too.
The fn tile is read once per chunk for all the block's tokens, which the one-token programs of mhc_triton.py
cannot share; Triton pipelines the chunks' loads (num_stages, 16-byte aligned tensors). After the D loop the
block's mixes are finished in registers, vectorised over its tokens (rms, sigmoids, the Sinkhorn rounds on
[BLOCK_T, hc, hc]), and a second pass over D normalises the block's collapsed rows in place
(w * (x * rstd), bf16), as mhc_triton.py's `_finish_token` does.

Rounding points are the reference's: fp32 math, bf16 casts of the new streams and of the collapse. Only the
order of the fp32 sums differs from the one-token kernel, so the two agree within summation order, not bit
for bit: the split launches of mhc_split.py keep mhc_triton.py's kernel (they must equal its one launch), and
the overlap pass splits only seams of at most CompileOptions.mhc_overlap_max_tokens (16) tokens, fewer than
ROWS_MIN_TOKENS.
"""

import triton
import triton.language as tl

from .mhc_sinkhorn_triton import _sinkhorn

# H200 sweep (scripts/sweep_mhc.py --rows, 11-30, mhc-rows-sweep-2026-11-30.json): this kernel takes ~230 us
# from 64 to 1024 tokens (one program's serial D walk), 359 us at 4096 and 705 at 8192, against the one-token
# kernel's 32 / 98 / 364 / 1443 / 2887 us at 64 / 256 / 1024 / 4096 / 8192: it wins from 1024 tokens on.
ROWS_MIN_TOKENS = 1024
# The fastest launch at every count swept; TF32x3 on tensor cores is 2.7-3.5x faster than "ieee" (fp32 FMAs)
# and agreed with the reference as closely (the sweep's check)
LAUNCH = dict(block_t=16, block_d=64, num_warps=4, precision="tf32x3")


@triton.jit
def _seam_rows_kernel(out_ptr, streams_ptr, post_ptr, comb_ptr, pre_lag_ptr, fn_ptr, scale_ptr, base_ptr, weight_ptr,
                      new_streams_ptr, normed_ptr, pre_out_ptr, post_out_ptr, comb_out_ptr, N, norm_eps, hc_eps, iters,
                      HC: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                      MIX_PAD: tl.constexpr, HAS_POST: tl.constexpr, PRECISION: tl.constexpr):
    MIX: tl.constexpr = (2 + HC) * HC
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = token < N
    row = token.to(tl.int64)
    i = tl.arange(0, HC)
    m = tl.arange(0, MIX_PAD)
    fn_rows = fn_ptr + m[None, :] * (HC * D)

    acc = tl.zeros((BLOCK_T, MIX_PAD), dtype=tl.float32)
    streams_ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    collapse_ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
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

    # the dot's columns as [tokens, hc] and [tokens, hc, hc]: a sum with one nonzero term, exact
    ab = 2 * HC + i[:, None] * HC + i[None, :]
    pre_dot = tl.sum(tl.where(m[None, None, :] == i[None, :, None], acc[:, None, :], 0.0), axis=2)
    post_dot = tl.sum(tl.where(m[None, None, :] == HC + i[None, :, None], acc[:, None, :], 0.0), axis=2)
    comb_dot = tl.sum(tl.where(m[None, None, None, :] == ab[None, :, :, None], acc[:, None, None, :], 0.0), axis=3)
    rms = tl.math.rsqrt(streams_ss / (HC * D) + norm_eps)
    pre = tl.sigmoid(pre_dot * rms[:, None] * tl.load(scale_ptr) + tl.load(base_ptr + i)[None, :]) + hc_eps
    post = 2 * tl.sigmoid(post_dot * rms[:, None] * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + i)[None, :])
    comb = _sinkhorn(comb_dot * rms[:, None, None] * tl.load(scale_ptr + 2) + tl.load(base_ptr + ab)[None, :, :],
                     hc_eps, iters)
    mix_rows = row[:, None] * HC + i[None, :]
    tl.store(pre_out_ptr + mix_rows, pre, mask=live[:, None])
    tl.store(post_out_ptr + mix_rows, post, mask=live[:, None])
    tl.store(comb_out_ptr + mix_rows[:, :, None] * HC + i[None, None, :], comb, mask=live[:, None, None])

    tl.debug_barrier()  # the collapsed rows read below were stored by other threads of this program
    rstd = tl.math.rsqrt(collapse_ss / D + norm_eps)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=3):  # pipelined loads, as in the D loop (with no dot, not by default)
        d = d0 + tl.arange(0, BLOCK_D)
        nd = normed_ptr + row[:, None] * D + d[None, :]
        mask = live[:, None] & (d < D)[None, :]
        x = tl.load(nd, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(nd, (w[None, :] * (x * rstd[:, None])).to(tl.bfloat16), mask=mask)


def seam_rows(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight, new_streams, normed, pre_out,
              post_out, comb_out, norm_eps, hc_eps, iters, has_post, launch=None):
    """One launch over contiguous flat tensors (streams [tokens, hc, D], the others to match; without has_post
    out/post/comb are placeholders) writing new_streams (with has_post), normed, pre_out, post_out, comb_out.
    launch: overrides of LAUNCH (scripts/sweep_mhc.py)."""
    unknown = set(launch or {}) - set(LAUNCH)
    if unknown:
        raise ValueError(f"mhc seam rows kernel: unknown launch keys {sorted(unknown)}, expected {sorted(LAUNCH)}")
    launch = {**LAUNCH, **(launch or {})}
    block_t = launch["block_t"]
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"mhc seam rows kernel: block_t={block_t}; tl.dot needs a power of 2 of at least 16 rows")
    tokens, hc, dim = streams.shape
    _seam_rows_kernel[(triton.cdiv(tokens, block_t),)](
        out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight, new_streams, normed, pre_out, post_out,
        comb_out, tokens, norm_eps, hc_eps, iters, HC=hc, D=dim, BLOCK_T=block_t, BLOCK_D=launch["block_d"],
        MIX_PAD=max(16, triton.next_power_of_2((2 + hc) * hc)), HAS_POST=has_post, PRECISION=launch["precision"],
        num_warps=launch["num_warps"])
