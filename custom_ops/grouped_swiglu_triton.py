"""Triton kernel of `dsflash::grouped_swiglu` (see grouped_swiglu.py for the math): one launch.

Grid (tile slot, column block of I), the tiles of mxfp4_experts_triton's grouped GEMM (`_tile_of`: a row tile
never mixes experts, slots past the last tile zero the rows past the last expert). A program reads its rows of
x through `order` (no gathered copy of x), streams its expert's W1 and W3 slices for its BLOCK_N columns side
by side into two accumulators, then rounds them as the two GEMMs' bf16 outputs, clamps, takes SwiGLU times the
pair's weight, rounds to bf16 and quantize-dequantizes h in groups of 32 columns (a group lies inside a block)
before its one store. The epilogue is routed_experts_triton's up kernel's (_swiglu_h), so both MoE paths
round alike.

With `splits` > 1 (a launch option for sweeps: the grid's last wave of tiles is part-empty when the tiles are
few, e.g. 9 experts x 36 column blocks at 8 warps on 132 SMs) the K blocks are split too: each split stores its
two fp32 partials, bumps its tile's counter (block_counters.py, lane "main") and the tile's last split adds them
in split order and runs the epilogue (deterministic; the sums' order differs from one split's, so the bits
may too).
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot
from .block_counters import block_counters
from .mxfp4_experts_triton import _tile_of
from .routed_experts_triton import _swiglu_h

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by the mean rows per stacked slice, the first entry up to its bound,
# and so on; blocks that compile for sm_90 without spills (two accumulators and the FP8 epilogue: at 4 warps
# 64 x 64 tiles and 128-wide K blocks spill; tests/test_grouped_swiglu.py). H200 sweep (scripts/sweep_experts.py
# --swiglu, flash-40l-e8 stacks, 12-02 q), us against w1 + w3 as two grouped GEMMs alone: 64 tokens 111.1 at
# (64, 64, 64, 8, 3) against 115.2 (116.4 at 64 x 32, 4 warps); 32 tokens (25 rows a slice) 112.8 against
# 109.7, 153 at 32-row tiles. The 16-row entry is untimed (decode below 17 tokens runs dsflash::routed_experts)
LAUNCHES = ((8, (16, 32, 64, 4, 3)), (None, (64, 64, 64, 8, 3)))


@triton.jit
def _grouped_swiglu_kernel(x_ptr, weights_ptr, order_ptr, w1_ptr, w3_ptr, offsets_ptr, h_ptr, partial_ptr, counter_ptr,
                           P, E, I, D, KK, limit, k_blocks_per_split, QUANT_H: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr, SPLITS: tl.constexpr,
                           FP32_DOT: tl.constexpr):
    slot, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert, first_row, row_end = _tile_of(slot, offsets_ptr, E, P, BLOCK_M, E_PAD)
    used = expert < E
    e = tl.minimum(expert, E - 1)  # keeps every address in bounds
    m = first_row + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (m < row_end) & used  # a tail slot's rows: zeros
    pair = tl.load(order_ptr + m, mask=live, other=0)
    x_rows = x_ptr + (pair // KK)[:, None] * D
    w_rows = (e.to(tl.int64) * I + n[:, None]) * D
    n_in = n < I
    first = split * k_blocks_per_split
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(tl.where(used, tl.minimum(k_blocks_per_split, tl.cdiv(D, BLOCK_K) - first), 0)):
        k = (first + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=live[:, None] & (k < D)[None, :], other=0.0)
        w_mask = n_in[:, None] & (k < D)[None, :]
        gate += _dot(x, tl.trans(tl.load(w1_ptr + w_rows + k[None, :], mask=w_mask, other=0.0)), FP32_DOT)
        up += _dot(x, tl.trans(tl.load(w3_ptr + w_rows + k[None, :], mask=w_mask, other=0.0)), FP32_DOT)
    finish = split == 0
    if SPLITS > 1:  # the tile's last split adds every split's partials in split order (deterministic), then finishes
        tile = slot * tl.num_programs(1) + pid_n
        mine = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        base = partial_ptr + tile.to(tl.int64) * (SPLITS * 2 * BLOCK_M * BLOCK_N) + mine
        tl.store(base + split * (2 * BLOCK_M * BLOCK_N), gate)
        tl.store(base + split * (2 * BLOCK_M * BLOCK_N) + BLOCK_M * BLOCK_N, up)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        finish = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel") == SPLITS - 1
        if finish:
            # .cg: bypass L1 (not coherent across SMs) to read what the other programs wrote
            gate = tl.load(base, cache_modifier=".cg")
            up = tl.load(base + BLOCK_M * BLOCK_N, cache_modifier=".cg")
            for s in range(1, SPLITS):
                gate += tl.load(base + s * (2 * BLOCK_M * BLOCK_N), cache_modifier=".cg")
                up += tl.load(base + s * (2 * BLOCK_M * BLOCK_N) + BLOCK_M * BLOCK_N, cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr + tile, 0)  # zero for the next launch
    if finish:
        h = _swiglu_h(gate, up, tl.load(weights_ptr + pair, mask=live, other=0.0), limit, QUANT_H)
        tl.store(h_ptr + m[:, None].to(tl.int64) * I + n[None, :], h.to(tl.bfloat16),
                 mask=(m < row_end)[:, None] & n_in[None, :])


def launch(rows: int, experts: int, **overrides) -> dict:
    """The launch at this shape (block_m, block_n, block_k, num_warps, num_stages, splits) from LAUNCHES by the
    mean rows per slice (shapes only: no host sync), with overrides (sweeps: scripts/sweep_experts.py --swiglu).
    splits: K split that many ways (default 1), the tile's last split finishing it."""
    per_slice = rows // experts
    settings = next(s for bound, s in LAUNCHES if bound is None or per_slice <= bound)
    keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    return {**dict(zip(keys, settings)), "splits": 1, **{k: v for k, v in overrides.items() if v is not None}}


def grouped_swiglu_triton(x, weights, order, w1, w3, offsets, limit, quantize_h, **overrides):
    """h bf16 [P, I] as the reference; overrides: `launch`'s keywords (sweeps)."""
    pairs = order.shape[0]
    experts, inter, dim = w1.shape
    settings = launch(pairs, experts, **overrides)
    block_m, block_n = settings["block_m"], settings["block_n"]
    if quantize_h and block_n % 32:
        raise ValueError(f"grouped_swiglu: with quantize_h, block_n ({block_n}) must be a multiple of 32 (the FP8 "
                         "groups of h)")
    h = x.new_empty(pairs, inter)
    if pairs == 0:
        return h
    # as grouped_mm_triton: enough slots for any routing, + 1 so the tail slots cover the rows past the last expert
    slots = pairs // block_m + min(experts, pairs) + 1
    column_blocks = triton.cdiv(inter, block_n)
    k_blocks = triton.cdiv(dim, settings["block_k"])
    per_split = triton.cdiv(k_blocks, settings["splits"])
    splits = triton.cdiv(k_blocks, per_split)  # no split left without K blocks
    tiles = slots * column_blocks
    partial = x.new_empty(tiles * splits * 2 * block_m * block_n if splits > 1 else 1, dtype=torch.float32)
    counters = block_counters(x.device, tiles) if splits > 1 else partial
    _grouped_swiglu_kernel[(slots, column_blocks, splits)](
        x.contiguous(), weights.contiguous(), order.contiguous(), w1.contiguous(), w3.contiguous(), offsets, h,
        partial, counters, pairs, experts, inter, dim, weights.shape[1], float(limit), per_split,
        QUANT_H=quantize_h, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=settings["block_k"],
        E_PAD=triton.next_power_of_2(experts), SPLITS=splits, FP32_DOT=x.device.type != "cuda",
        num_warps=settings["num_warps"], num_stages=settings["num_stages"])
    return h
