"""Triton kernel of `dsflash::mxfp4_grouped_mm` (see mxfp4_experts.py for the math): rows sorted by expert,
each expert's packed E2M1 weight dequantized in registers, tensor-core products accumulated in fp32.

No host sync, static grid: a row tile never mixes experts, so expert e needs ceil(rows_e / BLOCK_M) tiles,
and however the P rows fall, the tiles number at most P // BLOCK_M + min(E, P). The grid has that many
tile slots x output blocks; a slot finds its expert by a searchsorted over the cumulative tile counts
(torch, on the device) and slots past the last tile loop zero times. Only the selected experts' weights
are read: at decode (P = 6 rows per token) every tile is one token's row against one expert's slice,
the weight bytes a quarter of bf16's.

Dequantization reuses the attention's E2M1 -> E4M3 rewrite (`_e2m1_rows`: hardware conversion, then the
power-of-two scale, whose UE8M0 byte is the fp32 exponent field); exact in bf16. Only the fp32 summation
order differs from the reference (F.linear). A scale byte of 0 (2^-127) reads as 0.
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot, _e2m1_rows

BLOCK_M = 16  # decode rows per expert are few (one per token that picked it); tl.dot's smallest tile
BLOCK_N = 64
BLOCK_K = 128


@triton.jit
def _mxfp4_grouped_kernel(x_ptr, w_ptr, s_ptr, offsets_ptr, tile_expert_ptr, tile_first_ptr, out_ptr, E, N, K,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          FP32_DOT: tl.constexpr):
    slot, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + slot)
    used = expert < E  # slots past the last tile do nothing
    e = tl.minimum(expert, E - 1)  # keeps every address in bounds
    row_end = tl.where(used, tl.load(offsets_ptr + e), 0)
    expert_start = tl.where(e > 0, tl.load(offsets_ptr + e - 1, mask=e > 0, other=0), 0)
    m = expert_start + (slot - tl.load(tile_first_ptr + e)) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = m < row_end, n < N
    x_rows = x_ptr + m[:, None].to(tl.int64) * K
    w_rows = w_ptr + (e.to(tl.int64) * N + n[:, None]) * (K // 2)
    s_rows = s_ptr + (e.to(tl.int64) * N + n[:, None, None]) * tl.cdiv(K, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(tl.where(used, tl.cdiv(K, BLOCK_K), 0)):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=m_in[:, None] & (k < K)[None, :], other=0.0)
        kp = i * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_rows + kp[None, :], mask=n_in[:, None] & (kp < K // 2)[None, :], other=0)
        kt = i * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        exps = tl.load(s_rows + kt[None, :, None], mask=n_in[:, None, None] & (kt * 32 < K)[None, :, None], other=0)
        scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        w = _e2m1_rows(packed, scale, BLOCK_N, BLOCK_K, 32).to(tl.bfloat16)
        acc += _dot(x, tl.trans(w), FP32_DOT)
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(tl.bfloat16), mask=m_in[:, None] & n_in[None, :])


def tile_map(offsets: torch.Tensor, rows: int, block_m: int):
    """(expert of each tile slot (E past the last tile), first slot of each expert), on the device."""
    experts = offsets.shape[0]
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0, dtype=torch.int32)
    slots = torch.arange(rows // block_m + min(experts, rows), device=offsets.device, dtype=torch.int32)
    return torch.searchsorted(tile_end, slots, right=True).to(torch.int32), tile_end - tiles


def mxfp4_grouped_mm_triton(x, weight, scale, offsets, block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K,
                            num_warps=4):
    """bf16 [P, N] as the reference (rows past offsets[-1] are zero). Block sizes and warps for sweeps."""
    rows, k = x.shape
    experts, n, _ = weight.shape
    out = x.new_zeros(rows, n)
    if rows == 0:
        return out
    tile_expert, tile_first = tile_map(offsets, rows, block_m)
    _mxfp4_grouped_kernel[(tile_expert.shape[0], triton.cdiv(n, block_n))](
        x.contiguous(), weight.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8), offsets, tile_expert, tile_first, out,
        experts, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=x.device.type != "cuda",
        num_warps=num_warps)
    return out
