"""The mHC seam's finishing math (dsflash_compile/mhc.py) on register tiles, shared by the seam kernels
(mhc_triton.py, mhc_rows_triton.py): `_finish_token` adds one token's partials over the D chunks, then runs
its mixes (sigmoids, Sinkhorn) and normalises its collapsed row; the formulas live here once."""

import triton
import triton.language as tl


@triton.jit
def _sinkhorn(logits, hc_eps, iters):
    """[..., hc, hc] logits (row a = input stream) -> doubly stochastic comb, the reference's expressions and
    order: softmax over b + eps, columns, then (iters - 1) rounds of rows then columns, all fp32. One [4, 4]
    tile (the model's hc) takes _sinkhorn4, any other shape _sinkhorn_tile."""
    if len(logits.shape) == 2 and logits.shape[0] == 4 and logits.shape[1] == 4:
        return _sinkhorn4(logits, hc_eps, iters)
    return _sinkhorn_tile(logits, hc_eps, iters)


@triton.jit
def _sinkhorn_tile(logits, hc_eps, iters):
    """_sinkhorn on the tile's layout (reductions across threads)."""
    comb = tl.exp(logits - tl.max(logits, axis=-1, keep_dims=True))
    comb = comb / tl.sum(comb, axis=-1, keep_dims=True) + hc_eps
    comb = comb / (tl.sum(comb, axis=-2, keep_dims=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=-1, keep_dims=True) + hc_eps)
        comb = comb / (tl.sum(comb, axis=-2, keep_dims=True) + hc_eps)
    return comb


@triton.jit
def _quad(t):
    """[2, 2] -> its values as scalars, row-major."""
    c0, c1 = tl.split(t)
    t00, t10 = tl.split(c0)
    t01, t11 = tl.split(c1)
    return t00, t01, t10, t11


@triton.jit
def _sum4(a, b, c, d):
    """tl.sum's order over 4 lanes on the GPU (butterfly: lanes 2 apart, then 1 apart)."""
    return (a + c) + (b + d)


@triton.jit
def _reciprocal(s):
    """1 / s for s > 0 as rsqrt(s)^2: one hardware approximation (MUFU.RSQ) and a product, within ~3 fp32 ulps,
    where Triton's `/` adds range checks and rescaling around its reciprocal (~8 instructions)."""
    r = tl.math.rsqrt(s)
    return r * r


@triton.jit
def _normalize4(a, b, c, d, eps):
    inv = _reciprocal(_sum4(a, b, c, d) + eps)
    return a * inv, b * inv, c * inv, d * inv


@triton.jit
def _rows4(a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33, eps, FIRST: tl.constexpr):
    """One row step on 16 scalars (row-major; pass them transposed for a column step). FIRST: the softmax of the
    first round, exp(x - max) over the row divided by its sum, + eps; else x / (sum + eps)."""
    if FIRST:
        a00, a01, a02, a03 = _softmax4(a00, a01, a02, a03, eps)
        a10, a11, a12, a13 = _softmax4(a10, a11, a12, a13, eps)
        a20, a21, a22, a23 = _softmax4(a20, a21, a22, a23, eps)
        a30, a31, a32, a33 = _softmax4(a30, a31, a32, a33, eps)
    else:
        a00, a01, a02, a03 = _normalize4(a00, a01, a02, a03, eps)
        a10, a11, a12, a13 = _normalize4(a10, a11, a12, a13, eps)
        a20, a21, a22, a23 = _normalize4(a20, a21, a22, a23, eps)
        a30, a31, a32, a33 = _normalize4(a30, a31, a32, a33, eps)
    return a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33


@triton.jit
def _softmax4(a, b, c, d, eps):
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - m), tl.exp(b - m), tl.exp(c - m), tl.exp(d - m)
    inv = _reciprocal(_sum4(a, b, c, d))
    return a * inv + eps, b * inv + eps, c * inv + eps, d * inv + eps


@triton.jit
def _sinkhorn4(logits, hc_eps, iters):
    """_sinkhorn of one [4, 4] tile on 16 scalars, which every thread holds: a row or column sum is three adds in
    registers (on the tile two warp shuffles each), and each sum's reciprocal (_reciprocal) multiplies its 4
    values. Every thread runs all 16 values, so a round costs its instructions' issue and latency: with Triton's
    fp32 division (32, then 8 a round) the 19 later rounds still took ~2.1 us of a one-token seam's ~7.8 (H200,
    12-02 t), as on the tile. Values within a few fp32 ulps of the tile's (the same summation order)."""
    p = tl.permute(tl.reshape(logits, (2, 2, 2, 2)), (1, 3, 0, 2))  # [r0, c0, r1, c1]: row 2 r1 + r0, col 2 c1 + c0
    left, right = tl.split(p)
    q00, q10 = tl.split(left)
    q01, q11 = tl.split(right)
    a00, a01, a10, a11 = _quad(q00)
    a02, a03, a12, a13 = _quad(q01)
    a20, a21, a30, a31 = _quad(q10)
    a22, a23, a32, a33 = _quad(q11)
    a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33 = _rows4(
        a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33, hc_eps, True)
    a00, a10, a20, a30, a01, a11, a21, a31, a02, a12, a22, a32, a03, a13, a23, a33 = _rows4(  # columns
        a00, a10, a20, a30, a01, a11, a21, a31, a02, a12, a22, a32, a03, a13, a23, a33, hc_eps, False)
    for _ in range(iters - 1):
        a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33 = _rows4(
            a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33, hc_eps, False)
        a00, a10, a20, a30, a01, a11, a21, a31, a02, a12, a22, a32, a03, a13, a23, a33 = _rows4(  # columns
            a00, a10, a20, a30, a01, a11, a21, a31, a02, a12, a22, a32, a03, a13, a23, a33, hc_eps, False)
    i = tl.arange(0, 4)
    k = i[:, None] * 4 + i[None, :]
    row0 = tl.where(k == 0, a00, tl.where(k == 1, a01, tl.where(k == 2, a02, a03)))
    row1 = tl.where(k == 4, a10, tl.where(k == 5, a11, tl.where(k == 6, a12, a13)))
    row2 = tl.where(k == 8, a20, tl.where(k == 9, a21, tl.where(k == 10, a22, a23)))
    row3 = tl.where(k == 12, a30, tl.where(k == 13, a31, tl.where(k == 14, a32, a33)))
    return tl.where(k < 4, row0, tl.where(k < 8, row1, tl.where(k < 12, row2, row3)))


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
def _partial_rows(row, chunks, partial_ptr, PART: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Pointers to one token's partials rows [CHUNKS_PAD] and which of them are real chunks."""
    ch = tl.arange(0, CHUNKS_PAD)
    return partial_ptr + (row * chunks + ch) * PART, ch < chunks


@triton.jit
def _mix_sums(row, chunks, partial_ptr, HC: tl.constexpr, PART: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """One token's mix dot products ([hc] pre, [hc] post, [hc, hc] comb) and its streams' sum of squares, each
    added over the chunks in chunk order, from partials [tokens, chunks, PART]."""
    MIX: tl.constexpr = (2 + HC) * HC
    i = tl.arange(0, HC)
    rows, live = _partial_rows(row, chunks, partial_ptr, PART, CHUNKS_PAD)
    # .cg: bypass L1 (not coherent across SMs) to read what the other programs wrote
    pre_dot = tl.sum(tl.load(rows[:, None] + i[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg"), 0)
    post_dot = tl.sum(tl.load(rows[:, None] + HC + i[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg"), 0)
    comb_dot = tl.sum(tl.load(rows[:, None, None] + 2 * HC + i[None, :, None] * HC + i[None, None, :],
                              mask=live[:, None, None], other=0.0, cache_modifier=".cg"), 0)
    streams_ss = tl.sum(tl.load(rows + MIX, mask=live, other=0.0, cache_modifier=".cg"), 0)
    return pre_dot, post_dot, comb_dot, streams_ss


@triton.jit
def _store_mixes(row, pre, post, comb, pre_out_ptr, post_out_ptr, comb_out_ptr, HC: tl.constexpr):
    i = tl.arange(0, HC)
    tl.store(pre_out_ptr + row * HC + i, pre)
    tl.store(post_out_ptr + row * HC + i, post)
    tl.store(comb_out_ptr + row * HC * HC + i[:, None] * HC + i[None, :], comb)


@triton.jit
def _finish_token(row, chunks, partial_ptr, scale_ptr, base_ptr, weight_ptr, normed_ptr, pre_out_ptr, post_out_ptr,
                  comb_out_ptr, norm_eps, hc_eps, iters, HC: tl.constexpr, D: tl.constexpr, PART: tl.constexpr,
                  CHUNKS_PAD: tl.constexpr, NORM_BLOCK: tl.constexpr, mixes, collapse):
    """Sum one token's partials over the chunks, then mixes -> (pre, post, Sinkhorn comb) and the RMSNorm
    (each where its flag is on), from partials [tokens, chunks, PART]: MIX mix dot products, then the streams'
    and the collapse's sums of squares; the collapsed row is normalised in place."""
    MIX: tl.constexpr = (2 + HC) * HC
    if mixes != 0:
        pre_dot, post_dot, comb_dot, streams_ss = _mix_sums(row, chunks, partial_ptr, HC, PART, CHUNKS_PAD)
        pre, post, comb = _mixes(pre_dot, post_dot, comb_dot, streams_ss, scale_ptr, base_ptr, norm_eps, hc_eps,
                                 iters, HC, D)
        _store_mixes(row, pre, post, comb, pre_out_ptr, post_out_ptr, comb_out_ptr, HC)

    if collapse != 0:
        rows, live = _partial_rows(row, chunks, partial_ptr, PART, CHUNKS_PAD)
        collapse_ss = tl.sum(tl.load(rows + MIX + 1, mask=live, other=0.0, cache_modifier=".cg"), 0)
        for d0 in range(0, D, NORM_BLOCK):
            d = d0 + tl.arange(0, NORM_BLOCK)
            x = tl.load(normed_ptr + row * D + d, mask=d < D, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(weight_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            tl.store(normed_ptr + row * D + d, _rms_norm(x, w, collapse_ss, norm_eps, D), mask=d < D)
