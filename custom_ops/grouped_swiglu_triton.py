"""Triton kernel of `dsflash::grouped_swiglu` (see grouped_swiglu.py for the math): one launch.

Grid (tile slot, column block of I), the tiles of mxfp4_experts_triton's grouped GEMM (`_tile_of`: a row tile
never mixes experts, slots past the last tile zero the rows past the last expert). A program reads its rows of
x through `order` (no gathered copy of x), streams its expert's W1 and W3 slices for its BLOCK_N columns side
by side into two accumulators, then rounds them as the two GEMMs' bf16 outputs, clamps, takes SwiGLU times the
pair's weight, rounds to bf16 and quantize-dequantizes h in groups of 32 columns (a group lies inside a block)
before its one store. The epilogue is routed_experts_triton's up kernel's (_swiglu_h), so both MoE paths
round alike.

Measured and dropped (H200, 64 tokens, flash-40l-e8 stacks, scripts/sweep_experts.py --swiglu): a K split (the
tile's last split adding fp32 partials), 141-160 us against 111 (swiglu-sweep-2026-12-02-r.json); the FP8 of x
inside (each program rounding the x tiles it loads, as routed_experts' up kernel), 206.9 us against 111.3: the
rounding is redone by every column block's program (swiglu-sweep-quant-x-2026-12-02-r.json).
"""

import triton
import triton.language as tl

from .attention_triton import _dot
from .mxfp4_experts_triton import _tile_of
from .pdl import launch_options, pdl_wait
from .routed_experts_triton import _swiglu_h

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by the mean rows per stacked slice, the first entry up to its bound,
# and so on; blocks that compile for sm_90 without spills (two accumulators and the FP8 epilogue: at 4 warps
# 64 x 64 tiles and 128-wide K blocks spill; tests/test_grouped_swiglu.py). H200 sweep (scripts/sweep_experts.py
# --swiglu, flash-40l-e8 stacks, 12-02 q), us against w1 + w3 as two grouped GEMMs alone: 64 tokens 111.1 at
# (64, 64, 64, 8, 3) against 115.2 (116.4 at 64 x 32, 4 warps); 32 tokens (25 rows a slice) 112.8 against
# 109.7, 153 at 32-row tiles. The 16-row entry is untimed (decode below 17 tokens runs dsflash::routed_experts)
LAUNCHES = ((8, (16, 32, 64, 4, 3)), (None, (64, 64, 64, 8, 3)))


@triton.jit
def _grouped_swiglu_kernel(x_ptr, weights_ptr, order_ptr, w1_ptr, w3_ptr, offsets_ptr, h_ptr, P, E, I, D, KK, limit,
                           QUANT_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           E_PAD: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    slot, pid_n = tl.program_id(0), tl.program_id(1)
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
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(tl.where(used, tl.cdiv(D, BLOCK_K), 0)):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=live[:, None] & (k < D)[None, :], other=0.0)
        w_mask = n_in[:, None] & (k < D)[None, :]
        gate += _dot(x, tl.trans(tl.load(w1_ptr + w_rows + k[None, :], mask=w_mask, other=0.0)), FP32_DOT)
        up += _dot(x, tl.trans(tl.load(w3_ptr + w_rows + k[None, :], mask=w_mask, other=0.0)), FP32_DOT)
    h = _swiglu_h(gate, up, tl.load(weights_ptr + pair, mask=live, other=0.0), limit, QUANT_H)
    tl.store(h_ptr + m[:, None].to(tl.int64) * I + n[None, :], h.to(tl.bfloat16),
             mask=(m < row_end)[:, None] & n_in[None, :])


def launch(rows: int, experts: int, **overrides) -> dict:
    """The launch at this shape (block_m, block_n, block_k, num_warps, num_stages) from LAUNCHES by the mean rows
    per slice (shapes only: no host sync), with overrides (sweeps: scripts/sweep_experts.py --swiglu)."""
    per_slice = rows // experts
    settings = next(s for bound, s in LAUNCHES if bound is None or per_slice <= bound)
    keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    return {**dict(zip(keys, settings)), **{k: v for k, v in overrides.items() if v is not None}}


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
    _grouped_swiglu_kernel[(slots, triton.cdiv(inter, block_n))](
        x.contiguous(), weights.contiguous(), order.contiguous(), w1.contiguous(), w3.contiguous(), offsets, h,
        pairs, experts, inter, dim, weights.shape[1], float(limit), QUANT_H=quantize_h, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=settings["block_k"], E_PAD=triton.next_power_of_2(experts),
        FP32_DOT=x.device.type != "cuda", num_warps=settings["num_warps"], num_stages=settings["num_stages"],
        **launch_options(x.device))
    return h
