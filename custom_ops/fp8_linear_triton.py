"""Triton kernel of `dsflash::fp8_block_linear` (see fp8_linear.py for the math): bf16 activations, the FP8
weight dequantized tile by tile in registers, tensor-core products accumulated in fp32.

Decode is the regime that matters: a few tokens against a weight of 5-200 MB, a memory-bound GEMV whose
cost is the weight's bytes, now one per value instead of two. Grid (token block, output block, K split):
each program streams a [BLOCK_N, K / splits] slice of the E4M3 codes once, converts them in hardware,
multiplies each 32-column run by its tile's power-of-two scale (exact: the UE8M0 byte is the fp32
exponent field) and feeds tl.dot. Few outputs (wq_a: 1280, wkv: 512) would leave most SMs idle, so K is
split until about two programs per SM are busy; split programs store fp32 partials that one torch sum
adds in a fixed order (deterministic). With groups (the block-diagonal `wo_a`) an output block reads only
its group's inputs, which needs each group's outputs to be a multiple of BLOCK_N.

Numerics: each product of a bf16 activation and a dequantized weight is exact in fp32; only the fp32
summation order differs from the reference (F.linear), so results agree to about one bf16 rounding.
A scale byte of 0 (2^-127) reads as 0: the release's weight scales are far from it.
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot, _e4m3_rows, _num_sms

BLOCK_K = 128
PROGRAMS_PER_SM = 2
# Above this many rows (prefill) the op dequantizes the weight once and multiplies with cuBLAS (its reference):
# this kernel converts every weight tile again for each block of rows, ~5 CUDA-core instructions per value,
# which at large row counts costs more than the tensor-core work. A first guess: scripts/bench_native.py
# --tokens 1 8 64 256 1024 4096 measures the crossover on the H200.
MAX_ROWS = 256


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, x_stride, n_per_group, k_blocks_per_split,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PARTIAL: tl.constexpr, FP32_DOT: tl.constexpr):
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = m < M, n < N
    group = pid_n * BLOCK_N // n_per_group  # BLOCK_N divides n_per_group: one group per program
    x_rows = x_ptr + m[:, None].to(tl.int64) * x_stride + group * K
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    s_rows = s_ptr + (n // 32)[:, None, None] * tl.cdiv(K, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(k_blocks_per_split):
        k0 = (split * k_blocks_per_split + i) * BLOCK_K
        k = k0 + tl.arange(0, BLOCK_K)
        k_in = k < K
        x = tl.load(x_rows + k[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
        codes = tl.load(w_rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0)
        kt = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        exps = tl.load(s_rows + kt[None, :, None], mask=n_in[:, None, None] & (kt * 32 < K)[None, :, None], other=0)
        scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # UE8M0 byte = the fp32 exponent field
        w = _e4m3_rows(codes, scale, BLOCK_N, BLOCK_K, 32).to(tl.bfloat16)  # exact: 4 significant bits
        acc += _dot(x, tl.trans(w), FP32_DOT)
    out = m[:, None] * N + n[None, :]
    if PARTIAL:
        # int64: splits x rows x outputs passes 2^31 (32 x 4096 x 25600 in bench_native)
        tl.store(out_ptr + split.to(tl.int64) * M * N + out, acc, mask=m_in[:, None] & n_in[None, :])
    else:
        tl.store(out_ptr + out, acc.to(tl.bfloat16), mask=m_in[:, None] & n_in[None, :])


def block_n_for(n_per_group: int) -> int:
    return 64 if n_per_group % 64 == 0 else 32


def kernel_fits(x, weight, scale, groups) -> bool:
    """The inputs this kernel takes (else the op runs its reference): at most MAX_ROWS rows of bf16
    activations, an E4M3 weight whose groups hold a multiple of 32 outputs (so an output block never
    straddles two groups)."""
    return (x.dtype == torch.bfloat16 and x.numel() <= MAX_ROWS * x.shape[-1] and weight.dtype == torch.float8_e4m3fn and weight.dim() == 2
            and scale.dtype == torch.float8_e8m0fnu and groups >= 1 and weight.shape[0] % groups == 0
            and (weight.shape[0] // groups) % 32 == 0 and x.shape[-1] == groups * weight.shape[1])


def default_splits(tiles: int, k_blocks: int, device: torch.device) -> int:
    """K splits that bring the (token block, output block) tiles up to about PROGRAMS_PER_SM per SM."""
    return max(1, min(k_blocks, PROGRAMS_PER_SM * _num_sms(device) // tiles))


def fp8_block_linear_triton(x, weight, scale, groups=1, splits=None, block_m=None, block_n=None,
                            block_k=BLOCK_K, num_warps=4):
    """bf16 [..., N] as the reference. splits / block sizes / warps: None picks the defaults (for sweeps)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    (m, _), (n, k) = rows.shape, weight.shape
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    block_m = block_m or (16 if m <= 16 else 64)
    block_n = block_n or block_n_for(n // groups)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    per_split = triton.cdiv(k_blocks, splits or default_splits(tiles, k_blocks, x.device))
    splits = triton.cdiv(k_blocks, per_split)  # no split left without columns
    out = x.new_empty(splits, m, n, dtype=torch.float32) if splits > 1 else x.new_empty(m, n)
    _fp8_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)](
        rows, weight.view(torch.uint8), scale.view(torch.uint8), out, m, n, k, rows.stride(0), n // groups,
        per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=splits > 1,
        FP32_DOT=x.device.type != "cuda", num_warps=num_warps)
    if splits > 1:
        out = out.sum(0).to(torch.bfloat16)
    return out.view(*x.shape[:-1], n)
