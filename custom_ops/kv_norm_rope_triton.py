"""Triton kernel of `dsflash::kv_norm_rope` (see kv_norm_rope.py for the math): one program per row.

The row (D values, a power of two) is held in registers: its sum of squares, the RMSNorm (mhc_finish_triton's,
the seam's formula), the rotation of the trailing pairs (the row viewed as [D / 2, 2], the pairs before the tail kept)
and the FP8 rounding of its groups (fp8_qdq_triton's, quant.fp8_qdq's values bit for bit). The norm and
the RoPE products round to bf16 in integer arithmetic (_round_bf16), which the interpreter runs as the GPU does.

EARLY (the op's `early`, set by passes/early_reads.py where a kernel computed from the inputs' producers runs
between them and this one): the program releases the next kernel, loads and computes before its PDL wait and
only stores after it (pdl.py; the row comes from the wq_a + wkv projection, three launches back in the decode
step: its path would shrink to the wait and the store).
"""

import torch
import triton
import triton.language as tl

from .bf16_bits import _round_bf16
from .fp8_qdq_triton import _fp8_qdq_groups
from .mhc_finish_triton import _rms_norm_f32
from .pdl import launch_options, pdl_release, pdl_wait, pdl_wait_only
from .records import _FMT_ID, _fp8_record, kernel_view

MAX_DIM = 4096  # a row in registers (the release's 512 at 4 warps: 4 values a thread)
# The rotation's cos / sin loaded with the row and the norm weight (ROT_FIRST): else they come after the norm's
# barriers (the row's sum of squares) in the sm_90 code, a second round trip on the kernel's path. Loads only move
# (the same bits). Measured (H200, 12-04 d1): the kernel 1.6 us of a layer's path either way, the B1 step 10.247
# ms against 10.263 (3 of 5 rounds lower: noise): off
ROT_FIRST = False


@triton.jit
def _kv_norm_rope_kernel(kv_ptr, w_ptr, rot_ptr, out_ptr, row_stride, eps, ring_ptr, slots_ptr, seq, ring_slots,
                         ring_sb, ring_sn, slots_sb, slots_ss, D: tl.constexpr, PAIRS: tl.constexpr,
                         QUANT: tl.constexpr, EARLY: tl.constexpr, ROT_FIRST: tl.constexpr, RING: tl.constexpr,
                         PDL: tl.constexpr):
    """kv rows [N, D] (stride row_stride, unit column stride), rot [N, PAIRS, 2] and out [N, D] contiguous.
    RING (records' format id, -1: none): row b * seq + s also goes to ring[b, slots[b, s]] as a record of that
    format ("bf16" or "fp8": a window ring's), where the slot is in [0, ring_slots)."""
    if EARLY:
        pdl_release(PDL)
    else:
        pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    row = tl.program_id(0).to(tl.int64)
    y = _kv_row(kv_ptr, w_ptr, rot_ptr, row, row_stride, eps, D, PAIRS, QUANT, ROT_FIRST)
    if EARLY:
        pdl_wait_only(PDL)
    tl.store(out_ptr + row * D + tl.reshape(tl.arange(0, D), (1, D)), y.to(tl.bfloat16))
    if RING >= 0:
        _ring_write(y, row, ring_ptr, slots_ptr, seq, ring_slots, ring_sb, ring_sn, slots_sb, slots_ss, D, RING)


@triton.jit
def _ring_write(y, row, ring_ptr, slots_ptr, seq, ring_slots, ring_sb, ring_sn, slots_sb, slots_ss, D: tl.constexpr,
                RING: tl.constexpr):
    """Row b * seq + s (y: fp32 [1, D], on bf16's grid) to ring[b, slots[b, s]] as a record of format RING (records'
    id: 0 bf16, 1 fp8), where the slot is in [0, ring_slots)."""
    b = row // seq
    slot = tl.load(slots_ptr + b * slots_sb + (row % seq) * slots_ss).to(tl.int64)
    if (slot >= 0) & (slot < ring_slots):
        dst = ring_ptr + b * ring_sb + slot * ring_sn
        if RING == 0:  # bf16 values (exact: y is on bf16's grid)
            tl.store(dst + tl.reshape(tl.arange(0, D), (1, D)), y.to(tl.bfloat16))
        else:  # fp8: D E4M3 codes, then D / 32 UE8M0 scales
            code, e = _fp8_record(tl.reshape(y, (D // 32, 32)))
            tl.store(dst + tl.reshape(tl.arange(0, D), (D // 32, 32)), code.to(tl.uint8))
            tl.store(dst + D + tl.arange(0, D // 32), e.to(tl.uint8))


@triton.jit
def _kv_row(kv_ptr, w_ptr, rot_ptr, row, row_stride, eps, D: tl.constexpr, PAIRS: tl.constexpr, QUANT: tl.constexpr,
            ROT_FIRST: tl.constexpr):
    """One row's normed, rotated (and with QUANT FP8-rounded) values, fp32 [1, D]. ROT_FIRST: module notes."""
    d = tl.arange(0, D)
    j = tl.arange(0, D // 2) - (D // 2 - PAIRS)  # the pair's rotation; < 0 before the tail
    tail = j >= 0
    x = tl.load(kv_ptr + row * row_stride + d).to(tl.float32)
    w = tl.load(w_ptr + d).to(tl.float32)
    if ROT_FIRST:
        cos, sin = _rotation(rot_ptr, row, j, tail, PAIRS)
    normed = _round_bf16(_rms_norm_f32(x, w, tl.sum(x * x, 0), eps, D))
    even, odd = tl.split(tl.reshape(normed, (D // 2, 2)))
    if not ROT_FIRST:
        cos, sin = _rotation(rot_ptr, row, j, tail, PAIRS)
    rotated_even = tl.where(tail, _round_bf16(even * cos - odd * sin), even)
    rotated_odd = tl.where(tail, _round_bf16(even * sin + odd * cos), odd)
    y = tl.reshape(tl.join(rotated_even, rotated_odd), (1, D))
    if QUANT:
        y = _fp8_qdq_groups(y, 1, D)  # E4M3 values times a power of two: exact in bf16
    return y


@triton.jit
def _rotation(rot_ptr, row, j, tail, PAIRS: tl.constexpr):
    """cos, sin of the row's pairs j (1, 0 before the tail: j < 0), loaded as one [D / 2, 2] tile and split as the
    row's pairs are (two loads would each convert their layout, a barrier between them)."""
    pair = tl.load(rot_ptr + row * 2 * PAIRS + 2 * j[:, None] + tl.arange(0, 2)[None, :], mask=tail[:, None],
                   other=0.0)
    cos, sin = tl.split(pair)
    return tl.where(tail, cos, 1.0), sin


@triton.jit
def _qkv_norm_rope_kernel(kv_ptr, w_ptr, rot_ptr, out_ptr, q_ptr, q_w_ptr, q_out_ptr, kv_rows, row_stride,
                          q_row_stride, eps, ring_ptr, slots_ptr, seq, ring_slots, ring_sb, ring_sn, slots_sb,
                          slots_ss, D: tl.constexpr, PAIRS: tl.constexpr, QUANT: tl.constexpr, Q_D: tl.constexpr,
                          Q_PAD: tl.constexpr, RING: tl.constexpr, PDL: tl.constexpr):
    """`dsflash::qkv_norm_rope`: programs [0, kv_rows) take kv's rows as _kv_norm_rope_kernel does (RING too), the
    rest the query's rows [rows, Q_D] (stride q_row_stride): its RMSNorm by q_w, rounded to bf16 (layers.RMSNorm)."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    pid = tl.program_id(0)
    if pid < kv_rows:
        row = pid.to(tl.int64)
        y = _kv_row(kv_ptr, w_ptr, rot_ptr, row, row_stride, eps, D, PAIRS, QUANT, False)
        tl.store(out_ptr + row * D + tl.reshape(tl.arange(0, D), (1, D)), y.to(tl.bfloat16))
        if RING >= 0:
            _ring_write(y, row, ring_ptr, slots_ptr, seq, ring_slots, ring_sb, ring_sn, slots_sb, slots_ss, D, RING)
    else:
        row = (pid - kv_rows).to(tl.int64)
        c = tl.arange(0, Q_PAD)
        live = c < Q_D
        x = tl.load(q_ptr + row * q_row_stride + c, mask=live, other=0.0).to(tl.float32)
        weight = tl.load(q_w_ptr + c, mask=live, other=0.0).to(tl.float32)
        tl.store(q_out_ptr + row * Q_D + c, _round_bf16(_rms_norm_f32(x, weight, tl.sum(x * x, 0), eps, Q_D)),
                 mask=live)


def kernel_fits(kv) -> bool:
    """What the kernel takes of the op's checked inputs (else the op runs its reference): rows of a power of two
    from 64 (the shortest the tests run) up to MAX_DIM values."""
    dim = kv.shape[-1]
    return 64 <= dim <= MAX_DIM and dim & (dim - 1) == 0


RING_FORMATS = ("bf16", "fp8")  # the ring records the kernel writes (a window ring's formats)


def kv_norm_rope_triton(kv, weight, eps, rot, quantize, early=False, rot_first=None, ring=None, slots=None,
                        fmt="bf16"):
    """bf16 [..., T, D] as the reference; early: the kernel's EARLY (module docstring); rot_first: its ROT_FIRST
    (None: the module's). ring, slots, fmt: record_write_(ring, out, slots, fmt) in the same launch (kv [B, T, D],
    slots [B, T], fmt in RING_FORMATS)."""
    dim, pairs = kv.shape[-1], rot.shape[-2]
    rows = kv.reshape(-1, dim)  # a view for a column slice of a wider projection (wq_a + wkv's kv part)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    ring_args, ring_id = _ring_arguments(rows, kv, ring, slots, fmt)
    if rows.shape[0]:
        _kv_norm_rope_kernel[(rows.shape[0],)](rows, weight.contiguous(), rot.contiguous(), out, rows.stride(0),
                                               eps, *ring_args, D=dim, PAIRS=pairs, QUANT=quantize, EARLY=early,
                                               ROT_FIRST=ROT_FIRST if rot_first is None else rot_first,
                                               RING=ring_id, num_warps=4 if dim <= 1024 else 8,
                                               **launch_options(rows.device))
    return out


def _ring_arguments(rows, kv, ring, slots, fmt) -> tuple[tuple, int]:
    """The kernels' ring operands and RING id for record_write_(ring, out, slots, fmt) (ring None: -1, operands the
    kernel never reads)."""
    if ring is None:
        return (rows, rows, 1, 0, 0, 0, 0, 0), -1
    ring = kernel_view(ring, fmt)
    return (ring, slots, kv.shape[-2], ring.shape[1], ring.stride(0), ring.stride(1), slots.stride(0),
            slots.stride(1)), _FMT_ID[fmt]


def qkv_norm_rope_triton(q, q_weight, kv, weight, eps, rot, quantize, ring=None, slots=None, fmt="bf16"):
    """(qr, kv) bf16 as `dsflash::qkv_norm_rope`'s reference: one launch, a program a row of each. ring, slots, fmt:
    kv's rows also written to the ring, as kv_norm_rope_triton's."""
    dim, pairs, q_dim = kv.shape[-1], rot.shape[-2], q.shape[-1]
    rows, q_rows = kv.reshape(-1, dim), q.reshape(-1, q_dim)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    q_rows = q_rows if q_rows.stride(-1) == 1 else q_rows.contiguous()
    out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ring_args, ring_id = _ring_arguments(rows, kv, ring, slots, fmt)
    if rows.shape[0] + q_rows.shape[0]:
        _qkv_norm_rope_kernel[(rows.shape[0] + q_rows.shape[0],)](
            rows, weight.contiguous(), rot.contiguous(), out, q_rows, q_weight.contiguous(), q_out, rows.shape[0],
            rows.stride(0), q_rows.stride(0), eps, *ring_args, D=dim, PAIRS=pairs, QUANT=quantize, Q_D=q_dim,
            Q_PAD=triton.next_power_of_2(q_dim), RING=ring_id, num_warps=4 if max(dim, q_dim) <= 2048 else 8,
            **launch_options(rows.device))
    return q_out, out
