"""The mHC seam's finishing math (dsflash_compile/mhc.py) on register tiles, shared by the seam kernels: one
token's (mhc_triton.py) or a block of tokens' (mhc_rows_triton.py). Each kernel loads its own dot products and
sums of squares and stores the results in its own layout; the formulas live here once."""

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
    fp32: one token's ([hc], [hc], [hc, hc]; streams_ss a scalar) or a block's ([tokens, hc], [tokens, hc],
    [tokens, hc, hc]; streams_ss [tokens]). The dots are scaled by the streams' RMS, then split by sigmoids
    into pre and post; comb goes through the Sinkhorn rounds."""
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
