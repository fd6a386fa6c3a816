"""Triton kernel of `dsflash::attention_` (see attention.py for the math and the argument layout).

Grid: (query token, head group, key split). All H heads of a token share every key row (MQA), so a
program takes all of them (HG = 64 at the release shape, an M = 64 wgmma tile): each key block is loaded
and dequantized once per token and feeds two tensor-core products, S = Q [HG, D] K^T [D, BLOCK_N] and
acc [HG, D] += P [HG, BLOCK_N] K [BLOCK_N, D] (K = V), with Q and the block in shared memory and the
fp32 accumulator in registers (8 warps: 128 registers per thread). The op is compute-bound on Hopper
(84 MFLOP against 215-338 KB of records per token), so the design keeps the CUDA cores' share small:
FP8 codes convert in hardware, and NVFP4 nibbles are rewritten as E4M3 codes (same sign, exponent and
mantissa bits, value / 64) so they take the same hardware conversion (on the GPU in inline PTX, on whole
32-bit words; the interpreter runs the same rewrite in Triton).

The key list is the W' window entries (ring records or this chunk's bf16 rows) then the K compressed
ones; a split owns a run of BLOCK_N-entry blocks and walks its window blocks, then its compressed blocks
(two loops without branches in their bodies, so Triton pipelines the gathers: NUM_STAGES). With OWN_KEY
(one-token steps, dsflash::attention_own_key_) the chunk's one row, the token's own key, is made by each program
from its projection (kv_norm_rope_triton's row) instead of loaded, and one program a token writes it to the window
ring. With one split the program adds the sink, normalises, rotates the rope tail back and stores bf16; with
several (decode: one token's 640 keys must fill 132 SMs) it stores (acc, max, sum) and a merge kernel, one program
per (token, block of heads: merge_heads), combines the splits by log-sum-exp.

Where the time goes (H200, decode batch 64: ~51 us, ~104 TFLOP/s, 13% of a bf16 matmul; see
benchmarks/results/attention-2026-11-29-allheads.json): one 255-register program per SM runs its steps
one after another (gather, dequantize, store the block to shared memory, Q K^T, softmax, P V) with little
to overlap them; Triton lays out a dot whose result feeds another dot with all 8 warps along M, so both
warpgroups compute the same S (2x the Q K^T work and its shared-memory reads); and a 64-key block still
costs ~1950 instructions per thread (dequantization, wgmma descriptors, the accumulator rescale).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .kv_norm_rope_triton import RING_FORMATS, _kv_row, _ring_write, kernel_fits as key_row_fits
from .pdl import launch_options, pdl_wait
from .prefetch_l2 import prefetch_rows_l2
from .records import record_bytes

_FMT_ID = {"bf16": 0, "fp8": 1, "nvfp4": 2}
BLOCK_N = 64  # keys per step; 64 halves the per-key cost of re-reading Q from shared memory for Q K^T
SMALL_BLOCK_N = 32  # below SMALL_BATCH (token, head group) pairs, for twice the key splits
SMALL_BATCH = 32
NUM_WARPS = 8  # two warpgroups: the [64, 512] fp32 accumulator is 128 registers per thread
NUM_STAGES = 2  # the next block's records and indices are fetched (cp.async) while this one computes
MAX_HEAD_GROUP = 64  # an M = 64 wgmma tile: all heads of the release shape in one program
# One query token (decode batch 1): 16 heads a program, 4x the programs over the same key splits. H200, release
# decode shape, split + merge (scripts/sweep_attention.py, 12-01 l): 10.1 us against 13.6 with all 64 heads a
# program; at 8 tokens 64 heads stay the fastest (18.9 us against 25.8 at 16)
ONE_TOKEN_HEAD_GROUP = 16
# The merge's heads per program (merge_heads): up to 16 while 4 programs per SM remain. H200, release decode shape,
# attention + merge (sweep_attention.py --merge-only, 12-03 v): batch 64 49.9 us at 4 heads against 50.7 at 1 and
# 52.1 at 16; batch 8 19.2 at 2, 19.7 at 1, 24.6 at 4; batch 1 9.0 at 1, 11.2 at 2 (fewer programs for 20 splits)
MERGE_MAX_HEADS = 16
MERGE_PROGRAMS_PER_SM = 4
# Before its PDL wait each program asks L2 for the key records of its first block (PREFETCH_KEYS: at one token
# every split is one block): the window ring's and compressed cache's rows its index lists name, fetched from HBM
# while the kernels before still run, where its gathers after the wait (index list, then records: two dependent
# round trips) took most of its ~6.8 us of a layer's path (12-04 d5 trace). Hints only, always correct: a list
# still being written (an index source's top-k just before) names rows clamped into the caches, read again after
# the wait; nothing is stored before it. Records of a multiple of 16 bytes only (cp.async.bulk's rule: the
# release's). Off: not measured yet (12-05 f: no GPU; variant attention-prefetch in scripts/compile_and_profile.py)
PREFETCH_KEYS = False


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """bf16 x bf16 -> fp32 on tensor cores; FP32_DOT (the CPU interpreter, which has no bf16 dot) multiplies
    the same bf16 values in fp32, which is exact per product."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _e2m1_as_e4m3(packed):
    """Packed E2M1 bytes [N, P] (even element in the low nibble) -> E4M3 codes uint8 [N, 2P] of value / 64.
    E2M1 is sign, 2 exponent bits (bias 1), 1 mantissa bit; written into E4M3 (bias 7) as sign, the two low
    exponent bits and the top mantissa bit, a normal value scales by 2^(1-7) and a subnormal one (e = 0:
    m/2 in E2M1, m * 4/8 * 2^-6 in E4M3) by the same 2^-6. Four integer ops per nibble, no select."""
    N: tl.constexpr = packed.shape[0]
    P: tl.constexpr = packed.shape[1]
    lo = ((packed & 7) << 2) | ((packed & 8) << 4)
    hi = ((packed >> 2) & 0x1C) | (packed & 0x80)
    return tl.reshape(tl.join(lo, hi), (N, 2 * P)).to(tl.uint8)


@triton.jit
def _ue8m0_f32(exps):
    """UE8M0 scale bytes -> fp32 powers of two: the byte is the fp32 exponent field (0 reads as 0, not 2^-127)."""
    return (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_bf16(exps):
    """UE8M0 scale bytes -> bf16 powers of two: the byte is bf16's exponent field too."""
    return (exps.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3_rows(codes, scale, N: tl.constexpr, C: tl.constexpr, GROUP: tl.constexpr):
    """E4M3 codes uint8 [N, C] times one fp32 scale per GROUP values (scale [N, C/GROUP, 1]) -> fp32 [N, C].
    The code converts in hardware; the product is exact (code x power-of-two or E4M3 scale fits fp32)."""
    vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.reshape(tl.reshape(vals, (N, C // GROUP, GROUP)) * scale, (N, C))


@triton.jit
def _e2m1_rows(packed, scale, N: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr):
    """Packed E2M1 bytes [N, D/2] (even element in the low nibble) times one scale per GROUP values
    (scale [N, D/GROUP, 1] fp32) -> fp32 [N, D]. Exact while scale * 64 is finite (every E4M3 scale,
    UE8M0 scales up to 2^121)."""
    return _e4m3_rows(_e2m1_as_e4m3(packed), scale * 64.0, N, D, GROUP)


# _nvfp4_bf16x2's body. $4: 4 packed bytes; lo <- E4M3 codes of their low nibbles, hi <- of their high
# nibbles (value / 64); each cvt takes two codes; $5 / $6: the f16 scales x 64 of bytes 0-1 / 2-3; f16x2 ->
# bf16x2 through f32 (cvt.rn.bf16x2.f32 puts its first operand in the high half). Outputs $0-$1: low
# nibbles, $2-$3: high nibbles.
_NVFP4_PTX = tl.constexpr("""{
    .reg .b32 lo, hi, t, f0, f1, f2, f3, a0, a1;
    .reg .b16 l0, l1, h0, h1, x0, x1;
    and.b32 lo, $4, 0x07070707; shl.b32 lo, lo, 2; and.b32 t, $4, 0x08080808; shl.b32 t, t, 4; or.b32 lo, lo, t;
    shr.b32 hi, $4, 2; and.b32 hi, hi, 0x1C1C1C1C; and.b32 t, $4, 0x80808080; or.b32 hi, hi, t;
    mov.b32 {l0, l1}, lo; mov.b32 {h0, h1}, hi;
    cvt.rn.f16x2.e4m3x2 f0, l0; cvt.rn.f16x2.e4m3x2 f1, l1; cvt.rn.f16x2.e4m3x2 f2, h0; cvt.rn.f16x2.e4m3x2 f3, h1;
    mul.rn.f16x2 f0, f0, $5; mul.rn.f16x2 f1, f1, $6; mul.rn.f16x2 f2, f2, $5; mul.rn.f16x2 f3, f3, $6;
""" + "".join(f"""    mov.b32 {{x0, x1}}, f{i}; cvt.f32.f16 a0, x0; cvt.f32.f16 a1, x1; cvt.rn.bf16x2.f32 ${i}, a1, a0;
""" for i in range(4)) + "}")


@triton.jit
def _nvfp4_bf16x2(packed, scale):
    """GPU form of the NVFP4 decode (inline PTX; the interpreter takes _e2m1_as_e4m3 + _e4m3_rows): packed
    bytes uint8 [N, P] and each byte's f16 scale x 64 -> (low-nibble values, high-nibble values), bf16 [N, P]
    each. Per 4 bytes (8 values): the nibble -> E4M3 rewrite on the whole 32-bit word (9 integer ops),
    hardware E4M3x2 -> f16x2 conversions, the scale applied in f16x2 (exact: |product| in [2^-10, 2688], at
    most 6 significant bits), then f16 -> f32 -> bf16x2 (exact): 3.4 instructions per value against ~9 for
    the same steps written in Triton (which works on one byte per register)."""
    return tl.inline_asm_elementwise(
        asm=_NVFP4_PTX,
        constraints="=r,=r,=r,=r,r,r,r", args=[packed, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
        pack=4)


@triton.jit
def _load_rows(base, rows, row_stride, mask, D: tl.constexpr, FMT: tl.constexpr, PTX: tl.constexpr):
    """Rows `rows` [N] of a cache (records of format FMT) -> bf16 [N, D]; masked rows read as 0. Codes and
    scales are loaded as the contiguous byte runs they are; each scale multiplies its group through a
    [N, groups, group] view (exact in bf16: code x scale has at most 8 significant bits). PTX: the GPU's
    NVFP4 decode (_nvfp4_bf16x2) instead of the interpreter-safe one."""
    N: tl.constexpr = rows.shape[0]
    row_base = base + rows[:, None].to(tl.int64) * row_stride
    m2 = mask[:, None]
    if FMT == 0:  # bf16 rows
        return tl.load(row_base + tl.arange(0, D)[None, :], mask=m2, other=0.0)
    elif FMT == 1:  # fp8: D E4M3 codes, then D/32 UE8M0 scales
        codes = tl.load(row_base + tl.arange(0, D)[None, :], mask=m2, other=0)
        exps = tl.load(row_base + D + tl.arange(0, D // 32)[None, :], mask=m2, other=127).to(tl.int32)
        scale = _ue8m0_f32(exps)
        return _e4m3_rows(codes, scale[:, :, None], N, D, 32).to(tl.bfloat16)
    else:  # nvfp4: D/2 packed E2M1 (even element low nibble), then D/16 E4M3 scales
        packed = tl.load(row_base + tl.arange(0, D // 2)[None, :], mask=m2, other=0)
        scale = tl.load(row_base + D // 2 + tl.arange(0, D // 16)[None, :], mask=m2, other=0)
        scale = scale.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0  # undoes _e2m1_as_e4m3's 2^-6
        if PTX:  # each byte's scale, f16
            byte_scale = tl.reshape(tl.broadcast_to(scale.to(tl.float16)[:, :, None], (N, D // 16, 8)), (N, D // 2))
            lo, hi = _nvfp4_bf16x2(packed, byte_scale)
            return tl.reshape(tl.join(lo, hi), (N, D))
        else:
            return _e4m3_rows(_e2m1_as_e4m3(packed), scale[:, :, None], N, D, 16).to(tl.bfloat16)


@triton.jit
def _online_step(q, k, valid, m, l, acc, scale, FP32_DOT: tl.constexpr):
    """One key block k (= its values: one latent row per key) of the online softmax: scores, running max,
    rescaled sum and accumulator."""
    s = _dot(q, tl.trans(k), FP32_DOT) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(tl.bfloat16), k, FP32_DOT)
    return m_new, l, acc


@triton.jit
def _finish(acc, m, l, sink_ptr, heads, pos, freq_ptr, out_ptr, out_row, H: tl.constexpr, D: tl.constexpr,
            HALF_ROPE: tl.constexpr):
    """Add the sink, normalise, rotate the trailing rope dims back by the query position, store bf16."""
    HG: tl.constexpr = acc.shape[0]
    live = heads < H
    sink = tl.load(sink_ptr + heads, mask=live, other=0.0)
    l = l + tl.exp(sink - m)
    o = (acc / l[:, None]).to(tl.bfloat16).to(tl.float32)  # rounded before the rotation, as the reference
    rope_pair = tl.arange(0, D // 2) - (D // 2 - HALF_ROPE)
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
                      out_ptr, part_acc_ptr, part_ml_ptr, key_w_ptr, rot_ptr, slots_ptr,
                      S, K, chunk_sb, ring_sb, ring_sr, comp_sb, comp_sr, scale, blocks_per_split, comp_rows,
                      ring_bytes, comp_bytes, eps, slots_sb,
                      H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NW: tl.constexpr,
                      HALF_ROPE: tl.constexpr, HG: tl.constexpr, BLOCK_N: tl.constexpr,
                      WIN_FMT: tl.constexpr, CMP_FMT: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
                      PREFETCH: tl.constexpr, OWN_KEY: tl.constexpr, EARLY_KEY: tl.constexpr, PAIRS: tl.constexpr,
                      QUANT: tl.constexpr, PDL: tl.constexpr):
    """PREFETCH: the first block's key records asked of L2 before the PDL wait (PREFETCH_KEYS). OWN_KEY (S = 1):
    chunk_ptr holds the token's key projection (row stride chunk_sb), made into its key row with the norm weight
    key_w_ptr, eps, the rotation rot_ptr [tokens, PAIRS, 2] and QUANT (kv_norm_rope's row), and written to the
    ring at slots_ptr[b * slots_sb] by the token's first program; EARLY_KEY: made before the PDL wait."""
    tok = tl.program_id(0)
    group = tl.program_id(1)
    split = tl.program_id(2)
    b = tok // S
    if PREFETCH:  # hints: reads of lists that may still change, no store (PREFETCH_KEYS)
        _prefetch_block(ring_ptr + b.to(tl.int64) * ring_sb, widx_ptr + tok.to(tl.int64) * NW,
                        comp_ptr + b.to(tl.int64) * comp_sb, cidx_ptr + tok.to(tl.int64) * K,
                        split * blocks_per_split, K, ring_sr, comp_sr, comp_rows, ring_bytes, comp_bytes, W, NW,
                        BLOCK_N)
    if EARLY_KEY:  # its projection was written two launches back at least (attention_own_key.py), no store
        own = _kv_row(chunk_ptr, key_w_ptr, rot_ptr, tok.to(tl.int64), chunk_sb, eps, D, PAIRS, QUANT, False)
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    if OWN_KEY:
        if not EARLY_KEY:
            own = _kv_row(chunk_ptr, key_w_ptr, rot_ptr, tok.to(tl.int64), chunk_sb, eps, D, PAIRS, QUANT, False)
        if (group == 0) & (split == 0):  # its ring slot holds no key of this step (attention_own_key.py)
            _ring_write(own, tok.to(tl.int64), ring_ptr, slots_ptr, 1, W, ring_sb, ring_sr, slots_sb, 1, D, WIN_FMT)
    heads = group * HG + tl.arange(0, HG)  # a group may run past H (fewer heads than HG): masked
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok.to(tl.int64) * H * D + heads[:, None] * D + d[None, :], mask=(heads < H)[:, None],
                other=0.0)
    m = tl.full((HG,), -1e30, tl.float32)  # finite: a query with no valid key keeps acc = 0, not NaN
    l = tl.zeros((HG,), tl.float32)
    acc = tl.zeros((HG, D), tl.float32)
    n = tl.arange(0, BLOCK_N)

    win_blocks = tl.cdiv(NW, BLOCK_N)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, win_blocks + tl.cdiv(K, BLOCK_N))
    ring_base = ring_ptr + b.to(tl.int64) * ring_sb
    chunk_base = chunk_ptr + b.to(tl.int64) * chunk_sb  # its own length: the queries may be its last rows only
    for blk in range(first, tl.minimum(last, win_blocks)):  # window entries: a ring slot or a chunk row
        e = blk * BLOCK_N + n
        w = tl.load(widx_ptr + tok.to(tl.int64) * NW + e, mask=e < NW, other=-1)
        in_ring = (w >= 0) & (w < W)
        in_chunk = w >= W  # (decode: the token's own row; masked-off loads cost no memory traffic)
        if OWN_KEY:  # the chunk's one row is the token's key, made above
            chunk_k = tl.where(in_chunk[:, None], own.to(tl.bfloat16), tl.zeros((BLOCK_N, D), tl.bfloat16))
        else:
            chunk_k = _load_rows(chunk_base, w - W, D, in_chunk, D, 0, False)
        k = tl.where(in_ring[:, None], _load_rows(ring_base, w, ring_sr, in_ring, D, WIN_FMT, not INTERPRET), chunk_k)
        m, l, acc = _online_step(q, k, w >= 0, m, l, acc, scale, INTERPRET)
    comp_base = comp_ptr + b.to(tl.int64) * comp_sb
    for blk in range(tl.maximum(first, win_blocks), last):  # compressed entries: the top-k rows
        e = (blk - win_blocks) * BLOCK_N + n
        c = tl.load(cidx_ptr + tok.to(tl.int64) * K + e, mask=e < K, other=-1)
        k = _load_rows(comp_base, c, comp_sr, c >= 0, D, CMP_FMT, not INTERPRET)
        m, l, acc = _online_step(q, k, c >= 0, m, l, acc, scale, INTERPRET)

    if SPLIT:
        part = (tok.to(tl.int64) * H + heads) * tl.num_programs(2) + split  # [HG]
        live = heads < H
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=live[:, None])
        tl.store(part_ml_ptr + part * 2, m, mask=live)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=live)
    else:
        pos = tl.load(pos_ptr + tok)
        _finish(acc, m, l, sink_ptr, heads, pos, freq_ptr, out_ptr, tok.to(tl.int64) * H * D, H, D, HALF_ROPE)


@triton.jit
def _prefetch_block(ring, widx, comp, cidx, blk, K, ring_sr, comp_sr, comp_rows, ring_bytes, comp_bytes,
                    W: tl.constexpr, NW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Ask L2 for the records (ring_bytes / comp_bytes each) of key block `blk` of one token (ring / comp: its row's
    caches, widx / cidx: its lists), rows clamped into the caches (a chunk row, -1 or a stale entry names some cached
    row: a wasted hint at most)."""
    n = tl.arange(0, BLOCK_N)
    win_blocks: tl.constexpr = (NW + BLOCK_N - 1) // BLOCK_N
    if blk < win_blocks:
        e = blk * BLOCK_N + n
        rows = tl.minimum(tl.maximum(tl.load(widx + e, mask=e < NW, other=0), 0), W - 1)
        prefetch_rows_l2(ring + rows.to(tl.int64) * ring_sr, ring_bytes)
    else:
        e = (blk - win_blocks) * BLOCK_N + n
        rows = tl.minimum(tl.maximum(tl.load(cidx + e, mask=e < K, other=0), 0), comp_rows - 1)
        prefetch_rows_l2(comp + rows.to(tl.int64) * comp_sr, comp_bytes)


@triton.jit
def _merge_kernel(part_acc_ptr, part_ml_ptr, sink_ptr, pos_ptr, freq_ptr, out_ptr, nsplit,
                  H: tl.constexpr, D: tl.constexpr, HALF_ROPE: tl.constexpr, NSPLIT: tl.constexpr,
                  HEADS: tl.constexpr, PDL: tl.constexpr):
    """HEADS heads of one token (HEADS divides H): their splits' partials loaded at once ([HEADS, NSPLIT, D],
    NSPLIT a power of two >= the split count), combined by log-sum-exp, then finished like an unsplit program
    (one set of rotation angles for all HEADS heads: the token's)."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    tok = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    i = tl.arange(0, NSPLIT)
    part = (tok.to(tl.int64) * H + heads[:, None]) * nsplit + i[None, :]  # [HEADS, NSPLIT]
    ok = (i < nsplit)[None, :]
    m_i = tl.load(part_ml_ptr + part * 2, mask=ok, other=-1e30)
    m = tl.max(m_i, axis=1)  # [HEADS]
    w = tl.exp(m_i - m[:, None])
    l = tl.sum(tl.load(part_ml_ptr + part * 2 + 1, mask=ok, other=0.0) * w, axis=1)
    acc = tl.load(part_acc_ptr + part[:, :, None] * D + tl.arange(0, D)[None, None, :], mask=ok[:, :, None],
                  other=0.0)
    acc = tl.sum(acc * w[:, :, None], axis=1)  # [HEADS, D]
    pos = tl.load(pos_ptr + tok)
    _finish(acc, m, l, sink_ptr, heads, pos, freq_ptr, out_ptr, tok.to(tl.int64) * H * D, H, D, HALF_ROPE)


class OwnKey(NamedTuple):
    """attention_triton's `own_key`: chunk_kv is then the key projection [B, 1, D] (any row stride), made into the
    token's key as kv_norm_rope(kv, weight, eps, rot, quantize) and written to the ring at slots [B, 1] (a window
    format the kernel writes: RING_FORMATS); early: made before the PDL wait (attention_own_key.py says when)."""
    weight: torch.Tensor
    eps: float
    rot: torch.Tensor
    quantize: bool
    slots: torch.Tensor
    early: bool = False


def own_key_fits(q, chunk_kv, widx, window_fmt) -> bool:
    """What OwnKey takes: one-token steps (one query and one key row a batch row) with a window list, a window
    format the kernel writes, key rows kv_norm_rope's kernel takes."""
    return (q.shape[1] == 1 and chunk_kv.shape[1] == 1 and widx.shape[-1] > 0 and window_fmt in RING_FORMATS
            and key_row_fits(chunk_kv))


def merge_heads(tokens: int, heads: int, device: torch.device) -> int:
    """Heads per merge program: the most (a power of two up to MERGE_MAX_HEADS dividing `heads`) that still
    leave MERGE_PROGRAMS_PER_SM programs per SM."""
    most = 1
    while (most * 2 <= MERGE_MAX_HEADS and heads % (most * 2) == 0
           and tokens * heads // (most * 2) >= MERGE_PROGRAMS_PER_SM * _num_sms(device)):
        most *= 2
    return most


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: small, still exercises the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_triton(out, q, ring, chunk_kv, widx, compressed, cidx, sink, positions, inv_freq, scale,
                     window_fmt, compressed_fmt, num_splits: int | None = None, block_n: int | None = None,
                     num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES, head_group: int | None = None,
                     heads_per_merge: int | None = None, prefetch: bool | None = None, own_key: OwnKey | None = None):
    """Launch (the op's CUDA kernel; also callable directly, e.g. under TRITON_INTERPRET=1). num_splits,
    block_n, num_warps, num_stages and head_group (heads per program, a power of two >= 16) override the
    defaults (benchmark sweeps); heads_per_merge (a power of two dividing the heads) the merge's (`merge_heads`);
    prefetch: PREFETCH_KEYS (None: the module's), where the records allow it; own_key: the token's key made from
    chunk_kv, its projection, and written to the ring in this launch (OwnKey)."""
    batch, seq, heads, dim = q.shape
    if own_key is not None and not own_key_fits(q, chunk_kv, widx, window_fmt):
        raise ValueError(f"attention_triton: own_key takes one-token steps (q {tuple(q.shape)}, key projection "
                         f"{tuple(chunk_kv.shape)}, window list {tuple(widx.shape)}) with a {'/'.join(RING_FORMATS)} "
                         f"window ring ({window_fmt!r}) and key rows kv_norm_rope's kernel takes")
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
    tokens = batch * seq
    if head_group is None:  # tl.dot needs M >= 16
        most = MAX_HEAD_GROUP if tokens > 1 else ONE_TOKEN_HEAD_GROUP
        head_group = max(16, min(most, triton.next_power_of_2(heads)))
    groups = triton.cdiv(heads, head_group)
    if block_n is None:  # few tokens: smaller blocks give more splits to spread over the SMs
        block_n = BLOCK_N if tokens * groups >= SMALL_BATCH else SMALL_BLOCK_N
    total_blocks = triton.cdiv(nw, block_n) + triton.cdiv(k, block_n)
    if num_splits is None:  # fill the GPU once (one program per SM at 8 warps), never an empty split
        num_splits = max(1, min(total_blocks, _num_sms(q.device) // (tokens * groups)))
    per = triton.cdiv(total_blocks, num_splits)
    num_splits = triton.cdiv(total_blocks, per)
    widx = widx.to(torch.int32).contiguous()
    cidx = cidx.to(torch.int32).contiguous()
    positions = positions.contiguous()
    if compressed.numel() == 0:
        compressed = ring  # never read (K = 0); any valid pointer
    split = num_splits > 1
    # the records' rows 16-byte aligned and sized (cp.async.bulk), on the GPU (the interpreter runs no inline PTX)
    sizes = record_bytes(window_fmt, dim), record_bytes(compressed_fmt, dim)
    aligned = all(t.stride(1) * t.element_size() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
                  for t in (ring, compressed)) and all(n % 16 == 0 for n in sizes)
    prefetch = (PREFETCH_KEYS if prefetch is None else prefetch) and aligned and q.device.type == "cuda"
    per_merge = heads_per_merge or merge_heads(tokens, heads, q.device)
    if heads % per_merge or per_merge & (per_merge - 1):
        raise ValueError(f"attention_triton: heads_per_merge={per_merge} must be a power of two dividing the "
                         f"{heads} heads")
    part_acc = q.new_empty((tokens * heads * num_splits, dim) if split else (1,), dtype=torch.float32)
    part_ml = q.new_empty((tokens * heads * num_splits, 2) if split else (1,), dtype=torch.float32)
    if own_key is None:  # the chunk's bf16 rows; the key's operands are never read
        chunk, chunk_sb = chunk_kv.contiguous(), chunk_kv.shape[1] * dim
        key_weight, rot, slots, eps, pairs = chunk, chunk, widx, 0.0, 1
    else:  # the key projection's rows: a view of the projection's columns where it can be
        chunk = chunk_kv.reshape(batch, dim)
        chunk = chunk if chunk.stride(-1) == 1 else chunk.contiguous()
        chunk_sb, pairs = chunk.stride(0), own_key.rot.shape[-2]
        key_weight, rot = own_key.weight.contiguous(), own_key.rot.reshape(batch, pairs, 2).contiguous()
        slots, eps = own_key.slots, own_key.eps
    _attention_kernel[(tokens, groups, num_splits)](
        q.contiguous(), ring, chunk, widx, compressed, cidx, sink, positions, inv_freq, out, part_acc, part_ml,
        key_weight, rot, slots, seq, k, chunk_sb, ring.stride(0), ring.stride(1), compressed.stride(0),
        compressed.stride(1), scale, per, compressed.shape[1], *sizes, eps, slots.stride(0), H=heads, D=dim,
        W=window, NW=nw, HALF_ROPE=inv_freq.shape[0], HG=head_group, BLOCK_N=block_n, WIN_FMT=_FMT_ID[window_fmt],
        CMP_FMT=_FMT_ID[compressed_fmt], SPLIT=split, INTERPRET=q.device.type != "cuda", PREFETCH=prefetch,
        OWN_KEY=own_key is not None, EARLY_KEY=own_key is not None and own_key.early, PAIRS=pairs,
        QUANT=own_key is not None and own_key.quantize, num_warps=num_warps, num_stages=num_stages,
        **launch_options(q.device))
    if split:
        _merge_kernel[(tokens, heads // per_merge)](
            part_acc, part_ml, sink, positions, inv_freq, out, num_splits, H=heads, D=dim,
            HALF_ROPE=inv_freq.shape[0], NSPLIT=triton.next_power_of_2(num_splits), HEADS=per_merge, num_warps=4,
            **launch_options(out.device))
