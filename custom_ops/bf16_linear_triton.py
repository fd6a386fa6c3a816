"""Triton kernel of `dsflash::bf16_linear` (see bf16_linear.py for the math): one launch, split-K finished inside.

Grid (row block, output block, K split). Each program streams a [BLOCK_N, K / splits] slice of the weight once,
multiplying it by the row block's x (FP8 quantize-dequantized as loaded with QUANT_X: BLOCK_K holds whole
groups of 32 and a split starts on a block, so every group is rounded as in quant.fp8_qdq). Few outputs
(wq_a+wkv: 1792) would leave most SMs idle, so K is split until the programs fill the GPU. Split programs
store fp32 partials and bump their tile's counter; the last to arrive adds the partials in split order (the
same bits whichever program is last) and stores bf16, then resets the counter (block_counters.py: no memset
per call, CUDA-graph safe). With groups (the block-diagonal `wo_a`) an output block lies in one group and
reads only that group's inputs.

Numerics: bf16 x bf16 products are exact in fp32 and accumulate in fp32 (tensor cores), so only the summation
order differs from cuBLAS; the output is rounded to bf16 once, to nearest even (in integer arithmetic, which
the interpreter runs as the GPU does).
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot, _num_sms
from .bf16_bits import _round_bf16
from .bf16_linear import MAX_ROWS
from .block_counters import block_counters
from .fp8_qdq_triton import _fp8_qdq_groups
from .pdl import launch_options, pdl_wait

# Launch defaults from the H200 sweep at one row (scripts/sweep_linear.py, 12-01 l; us, against cuBLAS's GEMV and
# split-K reduce, not counting the FP8 kernel cuBLAS needs before it): wq_a+wkv 8.4 / 7.6, wq_b 23.1 / 23.6, wo_a
# 19.3 / 19.5, wo_b 25.5 / 26.7, indexer wq_b 6.5 / 4.8. Up to 16 rows 2 warps and 4 stages; 64-wide output
# blocks (4 warps, 2 stages: 2 warps spill) where those alone give about 3.7 programs per SM (wq_b: 23.5 us,
# against 28.0 for 32-wide blocks at 4 stages), else 32-wide with K split up to that count (wo_a's 256 blocks
# unsplit: 19.6 us against 21.0 split in two; wo_b's 160 in three); BLOCK_K 256 where K is split 4 ways or more
# (short runs per program), else 128.
BLOCK_K = 128  # 64 above 32 rows: the 64-row tile spills at 128 with QUANT_X (ptxas, sm_90)
PROGRAMS_PER_SM = 3.7


@triton.jit
def _bf16_linear_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, counter_ptr, rot_ptr, M, N, K, n_per_group,
                        k_blocks_per_split, splits, head_dim, QUANT_X: tl.constexpr, ONE_ROW: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        FP32_DOT: tl.constexpr, PAIRS: tl.constexpr, PDL: tl.constexpr):
    """x [M, groups * K] and out [M, N] contiguous; weight [N, K]. BLOCK_N divides n_per_group (so N too).
    ONE_ROW (M = 1, decode batch 1): x's FP8 runs on the one row, not on the dot's 16-row tile.
    PAIRS > 0: rot [M, PAIRS, 2]; each head_dim-wide head's trailing PAIRS pairs are rotated (_finish_tile), with
    the tile's (cos, sin) loaded before the K loop, so that the epilogue waits on no load but the partials'."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in = m < M
    if PAIRS > 0:
        rotation = _rotation_tile(rot_ptr, m, m_in, pid_n, head_dim, BLOCK_N, PAIRS)
    else:
        rotation = None
    group = pid_n * BLOCK_N // n_per_group
    x_rows = x_ptr + m[:, None].to(tl.int64) * (K * (N // n_per_group)) + group * K
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    first = split * k_blocks_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(tl.minimum(k_blocks_per_split, tl.cdiv(K, BLOCK_K) - first)):
        k = (first + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_in = (k < K) | EVEN_K
        if ONE_ROW:
            x = tl.load(x_ptr + group * K + k[None, :], mask=k_in[None, :], other=0.0)
            if QUANT_X:  # E4M3 values times a power of two: exact in bf16
                x = _fp8_qdq_groups(x.to(tl.float32), 1, BLOCK_K).to(tl.bfloat16)
            x = tl.where(m_in[:, None], x, 0.0).to(tl.bfloat16)  # the row, then zero rows up to the dot's 16
        else:
            x = tl.load(x_rows + k[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
            if QUANT_X:
                x = _fp8_qdq_groups(x.to(tl.float32), BLOCK_M, BLOCK_K).to(tl.bfloat16)
        w = tl.load(w_rows + k[None, :], mask=k_in[None, :], other=0.0)
        acc += _dot(x, tl.trans(w), FP32_DOT)
    out = m[:, None] * N + n[None, :]
    if splits == 1:
        tl.store(out_ptr + out, _finish_tile(acc, rotation, BLOCK_M, BLOCK_N, PAIRS), mask=m_in[:, None])
    else:
        tile_elems = BLOCK_M * BLOCK_N
        tile = pid_m * tl.num_programs(1) + pid_n
        mine = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(partial_ptr + (tile.to(tl.int64) * splits + split) * tile_elems + mine, acc)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        if tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel") == splits - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(splits):  # split order: deterministic
                total += tl.load(partial_ptr + (tile.to(tl.int64) * splits + s) * tile_elems + mine)
            tl.store(out_ptr + out, _finish_tile(total, rotation, BLOCK_M, BLOCK_N, PAIRS), mask=m_in[:, None])
            tl.atomic_xchg(counter_ptr + tile, 0)


@triton.jit
def _rotation_tile(rot_ptr, m, m_in, pid_n, head_dim, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr):
    """(tail, cos, sin) of the output tile's pairs: tail [BLOCK_N / 2] marks the pairs in a head's tail (pairs never
    straddle a block: BLOCK_N and head_dim are even); cos, sin [BLOCK_M, BLOCK_N / 2] (1, 0 off the tail)."""
    # the pair of each even column: its index in the head's tail (< 0 before the tail)
    j = (pid_n * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2)) % head_dim - (head_dim - 2 * PAIRS)
    tail = j >= 0
    at = rot_ptr + (m[:, None].to(tl.int64) * PAIRS + j[None, :] // 2) * 2
    live = m_in[:, None] & tail[None, :]
    return tail, tl.load(at, mask=live, other=1.0), tl.load(at + 1, mask=live, other=0.0)


@triton.jit
def _finish_tile(acc, rotation, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr):
    """The output tile in bf16: the fp32 sums rounded, then (PAIRS > 0) the RoPE of the pairs in a head's tail
    (rotation: _rotation_tile's), with rope_tail_triton.py's arithmetic (the rounded value rotated in fp32 and
    rounded again; its bits up to the compiler's FMA contraction)."""
    y = _round_bf16(acc)
    if PAIRS > 0:
        tail, cos, sin = rotation
        even, odd = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
        rotated_even = tl.where(tail[None, :], _round_bf16(even * cos - odd * sin), even)
        rotated_odd = tl.where(tail[None, :], _round_bf16(even * sin + odd * cos), odd)
        y = tl.reshape(tl.join(rotated_even, rotated_odd), (BLOCK_M, BLOCK_N))
    return y.to(tl.bfloat16)


def block_n_for(n_per_group: int) -> int | None:
    """The widest output block (32 or 16) that divides a group's outputs (64 only where `launch` finds enough
    of them); None: the kernel does not take it."""
    return next((b for b in (32, 16) if n_per_group % b == 0), None)


def kernel_fits(x, weight, groups) -> bool:
    """What the kernel takes of the op's checked inputs (else the op runs its reference): at most MAX_ROWS rows,
    groups whose outputs a 16-wide block divides."""
    return x.numel() <= MAX_ROWS * x.shape[-1] and block_n_for(weight.shape[0] // groups) is not None


def launch(rows: int, n: int, k: int, groups: int, device: torch.device, quantize_x: bool = True,
           **overrides) -> dict:
    """The launch at this shape (block_m, block_n, block_k, splits, num_warps, num_stages), with overrides (sweeps:
    scripts/sweep_linear.py). splits=None: enough K splits for about PROGRAMS_PER_SM programs per SM. Above 32
    rows without quantize_x (an input FP8-rounded before the op) 4 stages and, unsplit, 128-wide K blocks at 8 warps
    (4 spill on sm_90) (H200, 64 rows, 12-02 q: wo_a 23.6 us against 32.4 at 64 wide, 4 warps and 3 stages; wo_b
    28.7 against 31.8 at 3 stages)."""
    block_m = max(16, triton.next_power_of_2(rows))
    target = int(PROGRAMS_PER_SM * _num_sms(device))
    row_blocks = triton.cdiv(rows, block_m)
    wide = (n // groups) % 64 == 0 and row_blocks * (n // 64) >= target
    block_n = overrides.get("block_n") or (64 if wide else block_n_for(n // groups))
    splits = overrides.get("splits")
    if splits is None:
        splits = max(1, min(triton.cdiv(k, BLOCK_K), target // (row_blocks * (n // block_n))))
    tall = block_m > 32
    if tall:
        block_k = BLOCK_K if splits == 1 and not quantize_x else BLOCK_K // 2
    else:
        block_k = 2 * BLOCK_K if splits >= 4 else BLOCK_K
    block_k = overrides.get("block_k") or block_k
    few = block_m <= 16 and block_n == 32  # 64-wide blocks spill at 2 warps (ptxas, sm_90): 4 warps, 2 stages
    stages = 4 if few or (tall and not quantize_x) else 2 if block_m <= 16 else 3
    return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "splits": splits,
            "num_warps": overrides.get("num_warps") or (2 if few else 8 if tall and block_k == BLOCK_K else 4),
            "num_stages": overrides.get("num_stages") or stages}


def bf16_linear_triton(x, weight, groups, quantize_x, rot=None, head_dim=0, **overrides):
    """bf16 [..., N] as the reference (rot, head_dim: the op's RoPE epilogue); overrides: `launch`'s (sweeps)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    (m, _), (n, k) = rows.shape, weight.shape
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    settings = launch(m, n, k, groups, x.device, quantize_x, **overrides)
    block_n, block_k = settings["block_n"], settings["block_k"]
    if (n // groups) % block_n or (quantize_x and block_k % 32):
        raise ValueError(f"bf16_linear: block_n={block_n} must divide a group's {n // groups} outputs and, with "
                         f"quantize_x, block_k={block_k} be a multiple of 32 (the FP8 groups)")
    block_m = settings["block_m"]
    k_blocks = triton.cdiv(k, block_k)
    per_split = triton.cdiv(k_blocks, settings["splits"])
    splits = triton.cdiv(k_blocks, per_split)  # no split left without columns
    grid = (triton.cdiv(m, block_m), n // block_n, splits)
    out = x.new_empty(m, n)
    tiles = grid[0] * grid[1]
    partial = x.new_empty(tiles * splits * block_m * block_n if splits > 1 else 1, dtype=torch.float32)
    counters = block_counters(x.device, tiles) if splits > 1 else partial
    pairs = 0 if rot is None else rot.shape[-2]
    rot = partial if rot is None else rot.contiguous()  # (not read without pairs)
    _bf16_linear_kernel[grid](rows, weight.contiguous(), out, partial, counters, rot, m, n, k, n // groups, per_split,
                              splits, head_dim, QUANT_X=quantize_x, ONE_ROW=m == 1, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_K=block_k, EVEN_K=k % block_k == 0, FP32_DOT=x.device.type != "cuda", PAIRS=pairs,
                              num_warps=settings["num_warps"], num_stages=settings["num_stages"],
                              **launch_options(x.device))
    return out.view(*x.shape[:-1], n)
