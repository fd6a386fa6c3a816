"""Triton kernel of `dsflash::grouped_token_sum` (see grouped_token_sum.py for the math): one launch.

Grid (tile slot, column block of N): mxfp4_experts_triton's bf16 grouped GEMM tile (`_grouped_tile`), stored
bf16 as dsflash::grouped_mm stores it. Then each program bumps its column block's counter (block_counters.py,
lane "main": the MoE runs between the router and the seam kernels on their stream) and the block's last one
adds every token's pair rows there: each token's k rows located at once (ascending, then rank), then summed
in order in fp32 (the loads unrolled so they overlap), the first term as it is (the reference's sum starts
from it, not from 0). The launch leaves the counters at zero.
"""

import torch
import triton
import triton.language as tl

from .block_counters import block_counters
from .mxfp4_experts_triton import _grouped_tile, bf16_launch

SUM_TILE = 2048  # tokens x columns per step of the finishing program's sum (its 8 unrolled loads: larger spills)


@triton.jit
def _grouped_token_sum_kernel(x_ptr, w_ptr, offsets_ptr, out_ptr, rank_ptr, ascending_ptr, y_ptr, counter_ptr, P, E,
                              N, K, T, KK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, KK_PAD: tl.constexpr,
                              FP32_DOT: tl.constexpr):
    acc, m, n, m_in, n_in = _grouped_tile(x_ptr, w_ptr, w_ptr, offsets_ptr, P, E, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                          E_PAD, False, FP32_DOT, False)
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(tl.bfloat16), mask=m_in[:, None] & n_in[None, :])
    tl.debug_barrier()  # every thread's stores are issued before the release below
    pid_n = tl.program_id(1)
    if tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        s = tl.arange(0, KK_PAD)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            pairs = (t < T)[:, None] & (s < KK)[None, :]
            slot = tl.load(ascending_ptr + t[:, None] * KK + s[None, :], mask=pairs, other=0)
            rows = tl.load(rank_ptr + t[:, None] * KK + slot, mask=pairs, other=0)  # [BLOCK_T, KK_PAD]
            live = (t < T)[:, None] & n_in[None, :]
            for j in tl.static_range(KK_PAD):
                row = tl.sum(tl.where(s[None, :] == j, rows, 0), 1)
                # .cg: bypass L1 (not coherent across SMs) to read what the other programs wrote
                term = tl.load(out_ptr + row[:, None] * N + n[None, :], mask=live & (j < KK), other=0.0,
                               cache_modifier=".cg").to(tl.float32)
                if j == 0:
                    y = term
                else:
                    y = tl.where(j < KK, y + term, y)
            tl.store(y_ptr + t[:, None].to(tl.int64) * N + n[None, :], y, mask=live)
        tl.atomic_xchg(counter_ptr + pid_n, 0)  # zero for the next launch


def block_t(block_n: int) -> int:
    """Tokens per step of the finishing program's sum."""
    return max(1, SUM_TILE // block_n)


def grouped_token_sum_triton(x, weight, offsets, rank, ascending, **overrides):
    """fp32 [T, N] as the reference; overrides: the grouped GEMM's launch keywords (bf16_launch's)."""
    pairs, k_dim = x.shape
    experts, n, _ = weight.shape
    tokens, k = ascending.shape
    y = x.new_empty(tokens, n, dtype=torch.float32)
    if pairs == 0:
        return y.zero_()
    launch = {**bf16_launch(pairs, experts), **{key: v for key, v in overrides.items() if v is not None}}
    block_m, block_n = launch["block_m"], launch["block_n"]
    out = x.new_empty(pairs, n)  # the pairs' bf16 rows: written by the GEMM's programs, read by the finishing ones
    slots = pairs // block_m + min(experts, pairs) + 1  # as grouped_mm_triton
    column_blocks = triton.cdiv(n, block_n)
    _grouped_token_sum_kernel[(slots, column_blocks)](
        x.contiguous(), weight.contiguous(), offsets, out, rank.contiguous(), ascending.contiguous(), y,
        block_counters(x.device, column_blocks), pairs, experts, n, k_dim, tokens, k, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=launch["block_k"], E_PAD=triton.next_power_of_2(experts), BLOCK_T=block_t(block_n),
        KK_PAD=triton.next_power_of_2(k), FP32_DOT=x.device.type != "cuda", num_warps=launch["num_warps"],
        num_stages=launch["num_stages"])
    return y
