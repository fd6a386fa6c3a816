"""The mHC seam's finishing math (dsflash_compile/mhc.py) on register tiles, shared by the seam kernels
(mhc_triton.py, mhc_rows_triton.py): `_finish_token` adds one token's partials over the D chunks, then runs
its mixes (sigmoids, Sinkhorn) and normalises its collapsed row; the formulas live here once."""

import triton
import triton.language as tl


@triton.jit
def _sinkhorn(logits, hc_eps, iters):
    """[..., hc, hc] logits (row a = input stream) -> doubly stochastic comb, the reference's expressions and
    order: softmax over b + eps, columns, then (iters - 1) rounds of rows then columns, all fp32."""
    comb = tl.exp(logits - tl.max(logits, axis=-1, keep_dims=True))
    comb = comb / tl.sum(comb, axis=-1, keep_dims=True) + hc_eps
    comb = comb / (tl.sum(comb, axis=-2, keep_dims=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=-1, keep_dims=True) + hc_eps)
        comb = comb / (tl.sum(comb, axis=-2, keep_dims=True) + hc_eps)
    return comb


@triton.jit
def _mixes(pre_dot, post_dot, comb_dot, streams_ss, scale_ptr, base_ptr, norm_eps, hc_eps, iters,
           HC: tl.constexpr, D: tl.constexpr):
    """(pre, post, comb) from the (2 + hc) hc mix dot products and the sum of squares of the hc D stream values,
    fp32, one token's: [hc], [hc], [hc, hc] from a scalar streams_ss. The dots are scaled by the streams' RMS, then
    split by sigmoids into pre and post; comb goes through the Sinkhorn rounds."""
    i = tl.arange(0, HC)
    # rsqrt, then the broadcast over hc: the other way round, the sm_90 code ran the rsqrt once per hc value
    rms = tl.expand_dims(tl.math.rsqrt(streams_ss / (HC * D) + norm_eps), -1)
    pre = tl.sigmoid(pre_dot * rms * tl.load(scale_ptr) + tl.load(base_ptr + i)) + hc_eps
    post = 2 * tl.sigmoid(post_dot * rms * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + i))
    comb = (comb_dot * tl.expand_dims(rms, -1) * tl.load(scale_ptr + 2)
            + tl.load(base_ptr + 2 * HC + i[:, None] * HC + i[None, :]))
    return pre, post, _sinkhorn(comb, hc_eps, iters)


@triton.jit
def _rms_norm(x, weight, ss, norm_eps, D: tl.constexpr):
    """The collapse's RMSNorm rounded to bf16 (_rms_norm_f32's)."""
    return _rms_norm_f32(x, weight, ss, norm_eps, D).to(tl.bfloat16)


@triton.jit
def _rms_norm_f32(x, weight, ss, norm_eps, D: tl.constexpr):
    """The model's RMSNorm before its rounding, w * (x * rstd) in fp32, from the sum of squares ss of its D
    values: x fp32, one tile of a token's row (ss a scalar) or [tokens, columns] (ss [tokens]); weight that
    tile's columns. Loop-invariant rstd: the sm_90 code computes it once, outside the tile loop."""
    rstd = tl.expand_dims(tl.math.rsqrt(ss / D + norm_eps), -1)
    return weight * (x * rstd)


@triton.jit
def _finish_token(row, chunks, partial_ptr, scale_ptr, base_ptr, weight_ptr, normed_ptr, pre_out_ptr, post_out_ptr,
                  comb_out_ptr, norm_eps, hc_eps, iters, HC: tl.constexpr, D: tl.constexpr, PART: tl.constexpr,
                  CHUNKS_PAD: tl.constexpr, NORM_BLOCK: tl.constexpr, mixes, collapse):
    """Sum one token's partials over the chunks, then mixes -> (pre, post, Sinkhorn comb) and the RMSNorm
    (each where its flag is on), from partials [tokens, chunks, PART]: MIX mix dot products, then the streams'
    and the collapse's sums of squares; the collapsed row is normalised in place."""
    MIX: tl.constexpr = (2 + HC) * HC
    i = tl.arange(0, HC)
    ch = tl.arange(0, CHUNKS_PAD)
    rows = partial_ptr + (row * chunks + ch) * PART
    live = ch < chunks
    # .cg: bypass L1 (not coherent across SMs) to read what the other programs wrote
    if mixes != 0:
        pre_dot = tl.sum(tl.load(rows[:, None] + i[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg"), 0)
        post_dot = tl.sum(tl.load(rows[:, None] + HC + i[None, :], mask=live[:, None], other=0.0,
                                  cache_modifier=".cg"), 0)
        comb_dot = tl.sum(tl.load(rows[:, None, None] + 2 * HC + i[None, :, None] * HC + i[None, None, :],
                                  mask=live[:, None, None], other=0.0, cache_modifier=".cg"), 0)
        streams_ss = tl.sum(tl.load(rows + MIX, mask=live, other=0.0, cache_modifier=".cg"), 0)
        pre, post, comb = _mixes(pre_dot, post_dot, comb_dot, streams_ss, scale_ptr, base_ptr, norm_eps, hc_eps,
                                 iters, HC, D)
        tl.store(pre_out_ptr + row * HC + i, pre)
        tl.store(post_out_ptr + row * HC + i, post)
        tl.store(comb_out_ptr + row * HC * HC + i[:, None] * HC + i[None, :], comb)

    if collapse != 0:
        collapse_ss = tl.sum(tl.load(rows + MIX + 1, mask=live, other=0.0, cache_modifier=".cg"), 0)
        for d0 in range(0, D, NORM_BLOCK):
            d = d0 + tl.arange(0, NORM_BLOCK)
            x = tl.load(normed_ptr + row * D + d, mask=d < D, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(weight_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            tl.store(normed_ptr + row * D + d, _rms_norm(x, w, collapse_ss, norm_eps, D), mask=d < D)
