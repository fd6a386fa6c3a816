"""Triton kernel of `dsflash::compress_token_` (see compress_token.py for the math): one program a batch row.

The row's D values (a power of two) stay in registers from the projection to the records: the pooling over the
open group's R slots (the token's projection in its slot, the others from the pending state, which the program
then rewrites, after a barrier: every thread has read the slots first), the RMSNorm (the seam's formula), the keys'
projection (key_weight DK x D read in column blocks of BLOCK_K, each against the latent's matching block), their
norm, the RoPE of both rows (rope.apply_rope's bf16 rounding) and the records (records._store_groups, the
record_write_ kernel's encoders). The softmax is Inductor's form, exp(s - max) / sum, the division correctly rounded.

PREFETCH (the launch's PREFETCH_K): each program asks L2 for key_weight's rows before its PDL wait (a weight, which
no kernel writes; prefetch_l2.py), so the 128 KB of the release's wk are read from L2 by the one program a row.
"""

import triton
import triton.language as tl

from .bf16_bits import _bf16_as_f32, _f32_to_bf16, _round_bf16
from .kv_norm_rope_triton import _rotation
from .mhc_finish_triton import _rms_norm_f32
from .pdl import launch_options, pdl_wait
from .prefetch_l2 import prefetch_rows_l2
from .records import _BLOCK, _FMT_ID, _store_groups, kernel_view

MAX_DIM = 4096  # a row in registers
MAX_RATIO = 16  # the pooled group's slots in registers beside it
BLOCK_K = 32  # the keys' projection: a [DK, BLOCK_K] tile of key_weight a step (release: 16 steps of 128 x 32)
PREFETCH = True  # hints only (the same bits either way); not measured yet (12-05 i: no GPU)


@triton.jit
def _compress_token_kernel(kv_ptr, kv_sb, score_ptr, score_sb, pkv_ptr, pscore_ptr, pend_sb, source_ptr, source_sb,
                           complete_ptr, row_ptr, row_sb, rot_ptr, rot_sb, norm_w_ptr, eps, w_ptr, key_norm_w_ptr,
                           key_eps, comp_ptr, comp_sb, comp_sn, keys_ptr, keys_sb, keys_sn, rows,
                           D: tl.constexpr, DK: tl.constexpr, PAIRS: tl.constexpr, R: tl.constexpr,
                           RP: tl.constexpr, COMP_FMT: tl.constexpr, COMP_G: tl.constexpr, KEY_FMT: tl.constexpr,
                           KEY_G: tl.constexpr, BLOCK_K: tl.constexpr,
                           PREFETCH_K: tl.constexpr, PDL: tl.constexpr):
    """kv (bf16 at R = 1, else fp32 with score) [B, D] rows (strides kv_sb / score_sb); pending fp32 [Bmax, R, D]
    (row stride pend_sb, contiguous within); source [B, 2R], complete [B]; row_ids [B, groups] (row stride row_sb,
    group 0 read); rot [B, groups, PAIRS, 2] (row stride rot_sb); key_weight (w_ptr) bf16 [DK, D] contiguous; records
    of COMP_FMT / KEY_FMT (records' ids, -1: no keys; 0 is a bf16 tensor) at [b, row] of caches with `rows` rows."""
    b = tl.program_id(0).to(tl.int64)
    if PREFETCH_K > 0:  # a weight: no kernel writes it
        prefetch_rows_l2(w_ptr + tl.arange(0, DK).to(tl.int64) * D, PREFETCH_K * 2)
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    d = tl.arange(0, D)
    if R == 1:
        x = _bf16_as_f32(tl.load(kv_ptr + b * kv_sb + d))
    else:
        x = _round_bf16(_pool(kv_ptr + b * kv_sb, score_ptr + b * score_sb, pkv_ptr + b * pend_sb,
                              pscore_ptr + b * pend_sb, source_ptr + b * source_sb, complete_ptr + b, D, R, RP))
    latent = _round_bf16(_rms_norm_f32(x, _bf16_as_f32(tl.load(norm_w_ptr + d)), tl.sum(x * x, 0), eps, D))
    row = tl.load(row_ptr + b * row_sb).to(tl.int64)
    if (row >= 0) & (row < rows):
        rot = rot_ptr + b * rot_sb
        if KEY_FMT >= 0:
            k = _round_bf16(_project(latent, w_ptr, D, DK, BLOCK_K))
            k = _round_bf16(_rms_norm_f32(k, _bf16_as_f32(tl.load(key_norm_w_ptr + tl.arange(0, DK))),
                                          tl.sum(k * k, 0), key_eps, DK))
            _store_record(keys_ptr + b * keys_sb + row * keys_sn, _rope(k, rot, DK, PAIRS), DK, KEY_FMT, KEY_G)
        _store_record(comp_ptr + b * comp_sb + row * comp_sn, _rope(latent, rot, D, PAIRS), D, COMP_FMT, COMP_G)


@triton.jit
def _pool(kv_ptr, score_ptr, pkv_ptr, pscore_ptr, source_ptr, complete_ptr, D: tl.constexpr, R: tl.constexpr,
          RP: tl.constexpr):
    """The row's open group pooled (fp32 [D]), its pending state rewritten: the group left open (the token in its
    slot), or empty (0 / -inf) where the token closed it."""
    j = tl.arange(0, RP)
    at = j[:, None] * D + tl.arange(0, D)[None, :]
    live = (j < R)[:, None] & (at >= 0)
    token = (tl.load(source_ptr + j, mask=j < R, other=-1) >= 0)[:, None]  # its slot (one token: at most one)
    d = tl.arange(0, D)[None, :]
    buf_kv = tl.where(token, tl.load(kv_ptr + d), tl.load(pkv_ptr + at, mask=live, other=0.0))
    buf_score = tl.where(token, tl.load(score_ptr + d), tl.load(pscore_ptr + at, mask=live, other=-float("inf")))
    e = tl.exp(buf_score - tl.max(buf_score, 0)[None, :])
    pooled = tl.sum(buf_kv * tl.math.div_rn(e, tl.sum(e, 0)[None, :]), 0)
    closed = tl.load(complete_ptr) > 0
    tl.debug_barrier()  # the slots are read (by whichever thread holds them) before any is rewritten
    tl.store(pkv_ptr + at, tl.where(closed, 0.0, buf_kv), mask=live)
    tl.store(pscore_ptr + at, tl.where(closed, -float("inf"), buf_score), mask=live)
    return pooled


@triton.jit
def _project(latent, w_ptr, D: tl.constexpr, DK: tl.constexpr, BLOCK_K: tl.constexpr):
    """latent (fp32 [D]) times w^T (bf16 [DK, D], contiguous): fp32 [DK], products summed in fp32. The latent's block
    of each step is taken out of its registers by a masked sum (exact: one value and -0.0s)."""
    blocks = tl.reshape(latent, (D // BLOCK_K, BLOCK_K))
    which = tl.arange(0, D // BLOCK_K)[:, None]
    at = tl.arange(0, DK)[:, None] * D + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((DK, BLOCK_K), dtype=tl.float32)
    for i in tl.static_range(D // BLOCK_K):
        part = tl.sum(tl.where(which == i, blocks, -0.0), 0)
        acc += _bf16_as_f32(tl.load(w_ptr + at + i * BLOCK_K)) * part[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _rope(y, rot_ptr, N: tl.constexpr, PAIRS: tl.constexpr):
    """y (fp32 [N], on bf16's grid) with its trailing PAIRS pairs rotated by rot_ptr's (cos, sin) [PAIRS, 2] and
    rounded to bf16 (rope.apply_rope), the others kept. The pairs' halves are taken by masked sums with -0.0 (exact,
    signed zeros too) and put back by a select: kv_norm_rope_triton's split / join form, followed by the FP4 record
    encoders, gave the sm_90 code an 8-byte stack frame."""
    j = tl.arange(0, N // 2) - (N // 2 - PAIRS)
    tail = j >= 0
    cos, sin = _rotation(rot_ptr, 0, j, tail, PAIRS)
    pairs = tl.reshape(y, (N // 2, 2))
    first = (tl.arange(0, 2) == 0)[None, :]
    even = tl.sum(tl.where(first, pairs, -0.0), 1)
    odd = tl.sum(tl.where(first, -0.0, pairs), 1)
    even, odd = (tl.where(tail, _round_bf16(even * cos - odd * sin), even),
                 tl.where(tail, _round_bf16(even * sin + odd * cos), odd))
    return tl.reshape(tl.where(first, even[:, None], odd[:, None]), (N,))


@triton.jit
def _store_record(dst, y, N: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr):
    """y (fp32 [N], on bf16's grid) stored at dst as a record of format FMT (records' ids; 0: a bf16 cache row) in
    groups of G values (records._BLOCK)."""
    if FMT == 0:
        tl.store(dst + tl.arange(0, N), _f32_to_bf16(y))
    else:
        every = tl.arange(0, N // G) >= 0
        _store_groups(dst, 1, tl.reshape(y, (N // G, G)), every[:, None] & (tl.arange(0, G) >= 0)[None, :], every,
                      N, FMT, G, N // G)


def kernel_fits(kv, pending_kv, key_weight) -> bool:
    """The shapes the kernel takes (the op checks the record formats): rows of a power of two from 64 to MAX_DIM (and
    a multiple of BLOCK_K), key rows (key_weight None: no keys) of a power of two from 32, groups of at most MAX_RATIO
    slots."""
    def pow2(n, low):
        return low <= n <= MAX_DIM and n & (n - 1) == 0

    dim = kv.shape[-1]
    return (pow2(dim, 64) and dim % BLOCK_K == 0 and (pending_kv is None or pending_kv.shape[1] <= MAX_RATIO)
            and (key_weight is None or pow2(key_weight.shape[0], 32)))


def compress_token_triton(compressed, index_keys, pending_kv, pending_score, kv, score, source, complete, row_ids,
                          rot, weight, eps, key_weight, key_norm_weight, key_eps, quantize, compressed_fmt, index_fmt,
                          block_k=BLOCK_K, prefetch=None):
    """The op's launch (its checked arguments, inputs kernel_fits takes; quantize is then the records' own). block_k:
    the keys' projection step (a power of two); prefetch: PREFETCH (None: the module's; CUDA only)."""
    batch, _, dim = kv.shape
    if not batch:
        return
    kv = _rows(kv)
    pooled, keyed = score is not None, index_keys is not None
    # operands a launch without them never reads: stand-ins of the right kind
    score, pending_kv, pending_score = (_rows(score), pending_kv, pending_score) if pooled else (kv, kv, kv)
    source, complete = (source, complete) if pooled else (row_ids, row_ids)
    key_weight, key_norm_weight = (key_weight.contiguous(), key_norm_weight) if keyed else (weight, weight)
    if pooled and not (pending_kv.is_contiguous() and pending_score.is_contiguous()):
        raise ValueError("compress_token_triton: the pending state must be contiguous (the cache's)")
    comp = kernel_view(compressed, compressed_fmt)
    keys = kernel_view(index_keys, index_fmt) if keyed else comp
    prefetch = (PREFETCH if prefetch is None else prefetch) and keyed and kv.device.type == "cuda" \
        and key_weight.data_ptr() % 16 == 0
    rot = rot.contiguous()
    ratio = pending_kv.shape[1] if pooled else 1
    _compress_token_kernel[(batch,)](
        kv, kv.stride(0), score, score.stride(0), pending_kv, pending_score, pending_kv.stride(0), source,
        source.stride(0), complete, row_ids, row_ids.stride(0), rot, rot.stride(0), weight.contiguous(), eps,
        key_weight, key_norm_weight.contiguous(), key_eps, comp, comp.stride(0), comp.stride(1), keys, keys.stride(0),
        keys.stride(1), compressed.shape[1],
        D=dim, DK=key_weight.shape[0] if keyed else 1, PAIRS=rot.shape[-2], R=ratio, RP=triton.next_power_of_2(ratio),
        COMP_FMT=_FMT_ID[compressed_fmt], COMP_G=_BLOCK[compressed_fmt], KEY_FMT=_FMT_ID[index_fmt] if keyed else -1,
        KEY_G=_BLOCK[index_fmt], BLOCK_K=min(block_k, dim),
        PREFETCH_K=dim if prefetch else 0, num_warps=4 if dim <= 1024 else 8, **launch_options(kv.device))


def _rows(t):
    """[B, 1, D] -> [B, D] rows with unit column stride (a view where it has one)."""
    rows = t.reshape(t.shape[0], t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
