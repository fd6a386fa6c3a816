"""Triton kernel of the routed experts' grouped GEMMs: `dsflash::mxfp4_grouped_mm` (see mxfp4_experts.py for
the math) and, with bf16 weights, `dsflash::grouped_mm` (the decode path: few rows per expert). Rows sorted
by expert, tensor-core products accumulated in fp32; MXFP4 weights are dequantized in registers.

No host sync, static grid: a row tile never mixes experts, so expert e needs ceil(rows_e / BLOCK_M) tiles,
and however the P rows fall, the tiles number at most P // BLOCK_M + min(E, P). The grid has that many
tile slots x output blocks; a slot finds its expert by a searchsorted over the cumulative tile counts,
which every program computes from the E offsets (in the kernel: one launch per grouped GEMM, where the
same map in torch took several small kernels per call), and slots past the last tile loop zero times.
Only the selected experts' weights are read: at decode (P = 6 rows per token) every tile is one token's
row against one expert's slice, so the kernel streams each selected expert's weight once, with many
small output blocks to fill the SMs (torch._grouped_mm's CUTLASS kernel at 6 rows: ~2.3 TB/s of the
H200's 4.2 on bf16 weights, 11-30 trace).

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
# bf16 weights: twice the bytes per output row of MXFP4, so narrower output blocks for as many programs
# (6 experts x 2304 / 32 = 432 at decode). Not yet measured on the H200: scripts/sweep_experts.py
BF16_BLOCK_N = 32
BF16_BLOCK_K = 128
NUM_STAGES = 3  # Triton's default, what the MXFP4 launch has run with


@triton.jit
def _tile_of(slot, offsets_ptr, E, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """(expert of tile slot `slot`, E past the last tile; the expert's first slot): expert e has
    ceil(rows_e / BLOCK_M) tiles, numbered in expert order."""
    ex = tl.arange(0, E_PAD)
    ends = tl.load(offsets_ptr + ex, mask=ex < E, other=0)
    starts = tl.load(offsets_ptr + ex - 1, mask=(ex > 0) & (ex < E), other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    expert = tl.sum(((tile_end <= slot) & (ex < E)).to(tl.int32), 0)  # searchsorted(tile_end, slot, right=True)
    return expert, tl.sum(tl.where(ex == expert, tile_end - tiles, 0), 0)


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, s_ptr, offsets_ptr, out_ptr, E, N, K, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr, MXFP4: tl.constexpr,
                    FP32_DOT: tl.constexpr):
    """MXFP4: w packed E2M1 [E, N, K/2] with UE8M0 scales s [E, N, K/32]; else w bf16 [E, N, K] (s unused)."""
    slot, pid_n = tl.program_id(0), tl.program_id(1)
    expert, first_slot = _tile_of(slot, offsets_ptr, E, BLOCK_M, E_PAD)
    used = expert < E  # slots past the last tile do nothing
    e = tl.minimum(expert, E - 1)  # keeps every address in bounds
    row_end = tl.where(used, tl.load(offsets_ptr + e), 0)
    expert_start = tl.where(e > 0, tl.load(offsets_ptr + e - 1, mask=e > 0, other=0), 0)
    m = expert_start + (slot - first_slot) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = m < row_end, n < N
    x_rows = x_ptr + m[:, None].to(tl.int64) * K
    if MXFP4:
        w_rows = w_ptr + (e.to(tl.int64) * N + n[:, None]) * (K // 2)
    else:
        w_rows = w_ptr + (e.to(tl.int64) * N + n[:, None]) * K
    s_rows = s_ptr + (e.to(tl.int64) * N + n[:, None, None]) * tl.cdiv(K, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(tl.where(used, tl.cdiv(K, BLOCK_K), 0)):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=m_in[:, None] & (k < K)[None, :], other=0.0)
        if MXFP4:
            kp = i * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_rows + kp[None, :], mask=n_in[:, None] & (kp < K // 2)[None, :], other=0)
            kt = i * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
            exps = tl.load(s_rows + kt[None, :, None], mask=n_in[:, None, None] & (kt * 32 < K)[None, :, None],
                           other=0)
            scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            w = _e2m1_rows(packed, scale, BLOCK_N, BLOCK_K, 32).to(tl.bfloat16)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_in[:, None] & (k < K)[None, :], other=0.0)
        acc += _dot(x, tl.trans(w), FP32_DOT)
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(tl.bfloat16), mask=m_in[:, None] & n_in[None, :])


def grouped_mm_triton(x, weight, scale, offsets, block_m=BLOCK_M, block_n=None, block_k=None, num_warps=4,
                      num_stages=NUM_STAGES):
    """bf16 [P, N] as the reference (rows past offsets[-1] are zero). scale None: bf16 weight [E, N, K]; else
    MXFP4 weight and scale (mxfp4_experts.py). Block sizes (None: the format's default), warps and pipeline
    stages for sweeps."""
    mxfp4 = scale is not None
    block_n = block_n or (BLOCK_N if mxfp4 else BF16_BLOCK_N)
    block_k = block_k or (BLOCK_K if mxfp4 else BF16_BLOCK_K)
    rows, k = x.shape
    experts, n, _ = weight.shape
    out = x.new_zeros(rows, n)
    if rows == 0:
        return out
    weight = weight.contiguous()
    w, s = (weight.view(torch.uint8), scale.contiguous().view(torch.uint8)) if mxfp4 else (weight, weight)
    slots = rows // block_m + min(experts, rows)  # the most tiles any routing of the rows needs
    _grouped_kernel[(slots, triton.cdiv(n, block_n))](
        x.contiguous(), w, s, offsets, out, experts, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        E_PAD=triton.next_power_of_2(experts), MXFP4=mxfp4, FP32_DOT=x.device.type != "cuda",
        num_warps=num_warps, num_stages=num_stages)
    return out
