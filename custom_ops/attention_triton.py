"""Triton kernel of `dsflash::attention_` (see attention.py for the math and the argument layout).

Grid: (query token, head group of HG heads, key split). A program keeps q [HG, d] and an fp32
accumulator [HG, d]; it walks its share of the key list in blocks of BLOCK_N entries, loads each block's
rows once for all HG heads (window ring records or this chunk's bf16 rows, then compressed records),
dequantizes them in registers, and runs an online softmax (tl.dot on bf16 operands, fp32 accumulation).
With one split the program adds the sink, normalises, rotates the rope tail back and stores bf16; with
several (decode, where one token's 640 keys must fill 132 SMs) it stores (acc, max, sum) and a merge
kernel combines the splits by log-sum-exp. The W window entries come first, so a block of BLOCK_N
(a divisor of W) is all-window or all-compressed.
"""

import torch
import triton
import triton.language as tl

_FMT_ID = {"bf16": 0, "fp8": 1, "nvfp4": 2}
BLOCK_N = 32
HEAD_GROUP = 16


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """bf16 x bf16 -> fp32 on tensor cores; FP32_DOT (the CPU interpreter, which has no bf16 dot) multiplies
    the same bf16 values in fp32, which is exact per product."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _e2m1(code):
    """4-bit E2M1 code (int32) -> fp32 value (0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign), built from float
    bits with integer ops only (no transcendental): e > 0 is (1 + m/2) 2^(e-1), e = 0 is m/2."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_rows(packed, scale, N: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr):
    """Packed E2M1 bytes [N, D/2] (even element in the low nibble) times one scale per GROUP values
    (scale [N, D/GROUP, 1] fp32) -> fp32 [N, D]."""
    lo = tl.reshape(_e2m1(packed & 15), (N, D // GROUP, GROUP // 2)) * scale
    hi = tl.reshape(_e2m1(packed >> 4), (N, D // GROUP, GROUP // 2)) * scale
    return tl.reshape(tl.join(tl.reshape(lo, (N, D // 2)), tl.reshape(hi, (N, D // 2))), (N, D))


@triton.jit
def _load_rows(base, rows, row_stride, mask, D: tl.constexpr, FMT: tl.constexpr):
    """Rows `rows` [N] of a cache (records of format FMT) -> bf16 [N, D]; masked rows read as 0.
    Codes and scales are loaded as the contiguous byte runs they are, and each scale multiplies its
    group through a [N, groups, group] view (exact: code x scale fits bf16's 8 significant bits)."""
    N: tl.constexpr = rows.shape[0]
    row_base = base + rows[:, None].to(tl.int64) * row_stride
    m2 = mask[:, None]
    if FMT == 0:  # bf16 rows
        return tl.load(row_base + tl.arange(0, D)[None, :], mask=m2, other=0.0)
    elif FMT == 1:  # fp8: D E4M3 codes, then D/32 UE8M0 scales
        codes = tl.load(row_base + tl.arange(0, D)[None, :], mask=m2, other=0).to(tl.float8e4nv, bitcast=True)
        exps = tl.load(row_base + D + tl.arange(0, D // 32)[None, :], mask=m2, other=127).to(tl.int32)
        scale = (exps << 23).to(tl.float32, bitcast=True)  # UE8M0 byte = the fp32 exponent field
        vals = tl.reshape(codes.to(tl.float32), (N, D // 32, 32)) * scale[:, :, None]
        return tl.reshape(vals, (N, D)).to(tl.bfloat16)
    else:  # nvfp4: D/2 packed E2M1 (even element low nibble), then D/16 E4M3 scales
        packed = tl.load(row_base + tl.arange(0, D // 2)[None, :], mask=m2, other=0).to(tl.int32)
        scale = tl.load(row_base + D // 2 + tl.arange(0, D // 16)[None, :], mask=m2, other=0)
        scale = scale.to(tl.float8e4nv, bitcast=True).to(tl.float32)[:, :, None]
        return _e2m1_rows(packed, scale, N, D, 16).to(tl.bfloat16)


@triton.jit
def _finish(acc, m, l, sink_ptr, heads, pos, freq_ptr, out_ptr, out_row, H: tl.constexpr, D: tl.constexpr,
            HALF_ROPE: tl.constexpr, HG: tl.constexpr):
    """Add the sink, normalise, rotate the trailing rope dims back by the query position, store bf16."""
    live = heads < H
    sink = tl.load(sink_ptr + heads, mask=live, other=0.0)
    l = l + tl.exp(sink - m)
    o = (acc / l[:, None]).to(tl.bfloat16).to(tl.float32)  # rounded before the rotation, as the reference
    pairs = tl.arange(0, D // 2)
    rope_pair = pairs - (D // 2 - HALF_ROPE)
    freq = tl.load(freq_ptr + rope_pair, mask=rope_pair >= 0, other=0.0)  # 0: not a rope pair, no rotation
    angle = tl.maximum(pos, 0).to(tl.float32) * freq  # padding (-1) rotates by 0, as the reference
    c, s = tl.cos(angle), tl.sin(angle)
    x0, x1 = tl.split(tl.reshape(o, (HG, D // 2, 2)))
    y0 = x0 * c[None, :] + x1 * s[None, :]
    y1 = x1 * c[None, :] - x0 * s[None, :]
    o = tl.reshape(tl.join(y0, y1), (HG, D))
    d = tl.arange(0, D)
    tl.store(out_ptr + out_row + heads[:, None] * D + d[None, :], o.to(tl.bfloat16), mask=live[:, None])


@triton.jit
def _attention_kernel(q_ptr, ring_ptr, chunk_ptr, widx_ptr, comp_ptr, cidx_ptr, sink_ptr, pos_ptr, freq_ptr,
                      out_ptr, part_acc_ptr, part_ml_ptr,
                      S, K, ring_sb, ring_sr, comp_sb, comp_sr, scale, blocks_per_split,
                      H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NW: tl.constexpr,
                      HALF_ROPE: tl.constexpr, HG: tl.constexpr, BLOCK_N: tl.constexpr,
                      WIN_FMT: tl.constexpr, CMP_FMT: tl.constexpr, SPLIT: tl.constexpr, FP32_DOT: tl.constexpr):
    tok = tl.program_id(0)
    group = tl.program_id(1)
    split = tl.program_id(2)
    b = tok // S
    heads = group * HG + tl.arange(0, HG)  # a group may run past H (fewer heads than HG): masked
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok.to(tl.int64) * H * D + heads[:, None] * D + d[None, :], mask=(heads < H)[:, None],
                other=0.0)
    m = tl.full((HG,), -1e30, tl.float32)
    l = tl.zeros((HG,), tl.float32)
    acc = tl.zeros((HG, D), tl.float32)
    n = tl.arange(0, BLOCK_N)

    win_blocks = tl.cdiv(NW, BLOCK_N)
    for i in range(0, blocks_per_split):
        blk = split * blocks_per_split + i
        # (past the end: every entry invalid, the update is a no-op; keeps the loop bounds uniform)
        if blk < win_blocks:  # window entries: a ring slot, or a row of this chunk's kv
            e = blk * BLOCK_N + n
            w = tl.load(widx_ptr + tok.to(tl.int64) * NW + e, mask=e < NW, other=-1)
            in_ring = (w >= 0) & (w < W)
            k = _load_rows(ring_ptr + b.to(tl.int64) * ring_sb, w, ring_sr, in_ring, D, WIN_FMT)
            if tl.max((w >= W).to(tl.int32), axis=0) > 0:  # this chunk's own rows (decode: one per token)
                k_chunk = _load_rows(chunk_ptr + (b * S).to(tl.int64) * D, w - W, D, w >= W, D, 0)
                k = tl.where(in_ring[:, None], k, k_chunk)
            valid = w >= 0
        else:  # compressed entries: the top-k rows
            e = (blk - win_blocks) * BLOCK_N + n
            c = tl.load(cidx_ptr + tok.to(tl.int64) * K + e, mask=e < K, other=-1)
            k = _load_rows(comp_ptr + b.to(tl.int64) * comp_sb, c, comp_sr, c >= 0, D, CMP_FMT)
            valid = c >= 0
        s = _dot(q, tl.trans(k), FP32_DOT) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(tl.bfloat16), k, FP32_DOT)
        m = m_new

    if SPLIT:
        nsplit = tl.num_programs(2)
        part = (tok.to(tl.int64) * H + heads) * nsplit + split  # [HG]
        live = heads < H
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=live[:, None])
        tl.store(part_ml_ptr + part * 2, m, mask=live)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=live)
    else:
        pos = tl.load(pos_ptr + tok)
        _finish(acc, m, l, sink_ptr, heads, pos, freq_ptr, out_ptr, tok.to(tl.int64) * H * D, H, D, HALF_ROPE, HG)


@triton.jit
def _merge_kernel(part_acc_ptr, part_ml_ptr, sink_ptr, pos_ptr, freq_ptr, out_ptr, nsplit,
                  H: tl.constexpr, D: tl.constexpr, HALF_ROPE: tl.constexpr, HG: tl.constexpr):
    tok = tl.program_id(0)
    group = tl.program_id(1)
    heads = group * HG + tl.arange(0, HG)
    d = tl.arange(0, D)
    live = heads < H
    base = (tok.to(tl.int64) * H + heads) * nsplit
    m = tl.full((HG,), -1e30, tl.float32)
    for i in range(nsplit):
        m = tl.maximum(m, tl.load(part_ml_ptr + (base + i) * 2, mask=live, other=-1e30))
    l = tl.zeros((HG,), tl.float32)
    acc = tl.zeros((HG, D), tl.float32)
    for i in range(nsplit):
        w = tl.exp(tl.load(part_ml_ptr + (base + i) * 2, mask=live, other=-1e30) - m)
        l += tl.load(part_ml_ptr + (base + i) * 2 + 1, mask=live, other=0.0) * w
        acc += tl.load(part_acc_ptr + (base + i)[:, None] * D + d[None, :], mask=live[:, None], other=0.0) * w[:, None]
    pos = tl.load(pos_ptr + tok)
    _finish(acc, m, l, sink_ptr, heads, pos, freq_ptr, out_ptr, tok.to(tl.int64) * H * D, H, D, HALF_ROPE, HG)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, still exercises the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_triton(out, q, ring, chunk_kv, widx, compressed, cidx, sink, positions, inv_freq, scale,
                     window_fmt, compressed_fmt, num_splits: int | None = None, head_group: int = HEAD_GROUP,
                     block_n: int = BLOCK_N, num_warps: int = 4):
    """Launch (the op's CUDA kernel; also callable directly, e.g. under TRITON_INTERPRET=1). num_splits,
    head_group, block_n and num_warps override the defaults (benchmark sweeps)."""
    batch, seq, heads, dim = q.shape
    window, nw, k = ring.shape[1], widx.shape[-1], cidx.shape[-1]
    if not out.is_contiguous() or out.shape != q.shape:
        raise ValueError(f"attention_triton: out must be a contiguous {tuple(q.shape)} tensor")
    if chunk_kv.dtype != torch.bfloat16:
        raise TypeError(f"attention_triton: chunk_kv must be bf16, got {chunk_kv.dtype}")
    for name, cache, fmt in (("ring", ring, window_fmt), ("compressed", compressed, compressed_fmt)):
        if (fmt == "bf16") != (cache.dtype == torch.bfloat16):
            raise ValueError(f"attention_triton: {name} format {fmt!r} needs a "
                             f"{'bf16' if fmt == 'bf16' else 'uint8 record'} tensor, got {cache.dtype}")
    if nw + k == 0:  # no key at all: every output is 0, as in the reference
        out.zero_()
        return
    tokens, groups = batch * seq, triton.cdiv(heads, head_group)
    total_blocks = triton.cdiv(nw, block_n) + triton.cdiv(k, block_n)
    if num_splits is None:  # enough programs to fill the GPU once, never an empty split
        num_splits = max(1, min(total_blocks, triton.cdiv(_num_sms(q.device), tokens * groups)))
    per = triton.cdiv(total_blocks, num_splits)
    num_splits = triton.cdiv(total_blocks, per)
    widx = widx.to(torch.int32).contiguous()
    cidx = cidx.to(torch.int32).contiguous()
    if compressed.numel() == 0:
        compressed = ring  # never read (K = 0); any valid pointer
    split = num_splits > 1
    part_acc = q.new_empty((tokens * heads * num_splits, dim) if split else (1,), dtype=torch.float32)
    part_ml = q.new_empty((tokens * heads * num_splits, 2) if split else (1,), dtype=torch.float32)
    args = dict(H=heads, D=dim, W=window, NW=nw, HALF_ROPE=inv_freq.shape[0], HG=head_group, BLOCK_N=block_n,
                WIN_FMT=_FMT_ID[window_fmt], CMP_FMT=_FMT_ID[compressed_fmt], SPLIT=split,
                FP32_DOT=q.device.type != "cuda")
    _attention_kernel[(tokens, groups, num_splits)](
        q.contiguous(), ring, chunk_kv.contiguous(), widx, compressed, cidx, sink, positions.contiguous(), inv_freq,
        out, part_acc, part_ml, seq, k, ring.stride(0), ring.stride(1), compressed.stride(0), compressed.stride(1),
        scale, per, num_warps=num_warps, **args)
    if split:
        _merge_kernel[(tokens, groups)](part_acc, part_ml, sink, positions.contiguous(), inv_freq, out, num_splits,
                                        H=heads, D=dim, HALF_ROPE=inv_freq.shape[0], HG=head_group, num_warps=4)
