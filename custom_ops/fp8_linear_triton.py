"""Triton kernel of `dsflash::fp8_block_linear` (see fp8_linear.py for the math): bf16 activations, the FP8
weight dequantized tile by tile in registers, tensor-core products accumulated in fp32.

Decode is the regime that matters: a few tokens against a weight of 5-200 MB, a memory-bound GEMV whose
cost is the weight's bytes, one per value instead of two. Grid (token block, output block, K split): each
program streams a [BLOCK_N, K / splits] slice of the E4M3 codes once and feeds tl.dot with bf16 values.
Few outputs (wq_a: 1280, wkv: 512) would leave most SMs idle, so K is split until about PROGRAMS_PER_SM
programs per SM are busy; split programs store fp32 partials that one small kernel adds in a fixed order
(deterministic) and rounds to bf16. With groups (the block-diagonal `wo_a`) an output block reads only its
group's inputs, which needs each group's outputs to be a multiple of BLOCK_N.

Where decode time went (11-30, H200): ~8 CUDA-core instructions per weight value (Triton converts one byte
per register: byte shuffles, E4M3 -> f16 -> f32, an fp32 multiply by the scale, f32 -> bf16), a tile scale
load in every iteration that waited a full memory latency (a byte gather is no cp.async candidate, so the
pipeliner left it in place), and two torch kernels (sum, cast) after split programs. Now the scales of the
next K block are loaded one iteration ahead and the split sum is one kernel; an inline-PTX conversion on 4
codes per register (2.5 instructions per value, exact) is the default on CUDA up to PTX_MAX_ROWS rows (PTX):
on the H200 (11-30 b, scripts/sweep_native.py) mostly 3-8% faster than the Triton conversion at 1-8 tokens,
0.92-1.02x at 64.

Numerics: every product of a bf16 activation and a dequantized weight is exact in fp32 (code x 2^e is the
reference's bf16 weight, rounded the same way where it is subnormal); only the fp32 summation order differs
from the reference (F.linear), so results agree to about one bf16 rounding. A scale byte of 0 (2^-127)
reads as 0: the release's weight scales are far from it.
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot, _e4m3_rows, _num_sms, _ue8m0_bf16, _ue8m0_f32
from .pdl import launch_options, pdl_wait

BLOCK_K = 128
PROGRAMS_PER_SM = 2
NUM_STAGES = 3  # Triton's default, what the launch has run with
PTX = True  # the inline-PTX conversion on CUDA (False: the same math in Triton, the interpreter's path)
PTX_MAX_ROWS = 8  # above it the Triton conversion, at least as fast at 64 rows on the H200 (sweep_native, 11-30 b)
# Above this many rows (prefill) the op dequantizes the weight once and multiplies with cuBLAS (its reference):
# this kernel converts every weight tile again for each block of rows (~5 CUDA-core instructions per value
# in all), which at large row counts costs more than the tensor-core work. A first guess: scripts/bench_native.py
# --tokens 1 8 64 256 1024 4096 measures the crossover on the H200.
MAX_ROWS = 256
# A separate launch: the sum in the kernel (each tile's last split program) measured no faster (H200, 11-30 e)
SUM_BLOCK = 1024


# _e4m3_bf16's body. $2: 4 E4M3 codes; $3-$4: their bf16 scales, two per register; outputs $0-$1: the 4
# products as bf16x2. cvt.rn.f16x2.e4m3x2 is exact (E4M3 fits f16); f16 -> f32 -> bf16 is exact (4
# significant bits); cvt.rn.bf16x2.f32 puts its first operand in the high half.
_E4M3_PTX = tl.constexpr("""{
    .reg .b16 c0, c1, h0, h1, h2, h3;
    .reg .b32 f0, f1, p0, p1;
    .reg .f32 a0, a1, a2, a3;
    mov.b32 {c0, c1}, $2;
    cvt.rn.f16x2.e4m3x2 f0, c0; cvt.rn.f16x2.e4m3x2 f1, c1;
    mov.b32 {h0, h1}, f0; mov.b32 {h2, h3}, f1;
    cvt.f32.f16 a0, h0; cvt.f32.f16 a1, h1; cvt.f32.f16 a2, h2; cvt.f32.f16 a3, h3;
    cvt.rn.bf16x2.f32 p0, a1, a0; cvt.rn.bf16x2.f32 p1, a3, a2;
    mul.rn.bf16x2 $0, p0, $3; mul.rn.bf16x2 $1, p1, $4;
}""")


@triton.jit
def _e4m3_bf16(codes, exps, PTX: tl.constexpr):
    """E4M3 codes uint8 [N, C] times their 32-column tiles' power-of-two scales (UE8M0 bytes exps [N, C / 32])
    -> bf16 [N, C], the reference's dequantized values (the product rounds as torch's where it is subnormal).
    PTX: per 4 codes two E4M3x2 -> f16x2, four f16 -> f32, two f32 pairs -> bf16x2 and two bf16x2 multiplies
    by the scales as bf16 (the byte is bf16's exponent field), on whole registers. Else the 11-30 conversion
    (attention_triton._e4m3_rows: the code in fp32 times the tile's fp32 scale, one bf16 rounding)."""
    N: tl.constexpr = codes.shape[0]
    C: tl.constexpr = codes.shape[1]
    if PTX:
        scale = _ue8m0_bf16(exps)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (N, C // 32, 32)), (N, C))
        return tl.inline_asm_elementwise(asm=_E4M3_PTX, constraints="=r,=r,r,r,r", args=[codes, scale],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)
    scale = _ue8m0_f32(exps)
    return _e4m3_rows(codes, scale[:, :, None], N, C, 32).to(tl.bfloat16)


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, x_stride, n_per_group, k_blocks_per_split,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PARTIAL: tl.constexpr, FP32_DOT: tl.constexpr, PTX: tl.constexpr,
                       EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_N divides N (a multiple of 32 per group), so weight rows need no mask; EVEN_K: BLOCK_K divides K,
    so no column mask either (every release shape)."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in = m < M
    group = pid_n * BLOCK_N // n_per_group  # BLOCK_N divides n_per_group: one group per program
    x_rows = x_ptr + m[:, None].to(tl.int64) * x_stride + group * K
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    s_rows = s_ptr + (n // 32)[:, None] * tl.cdiv(K, 32)
    first = split * k_blocks_per_split
    blocks = tl.minimum(k_blocks_per_split, tl.cdiv(K, BLOCK_K) - first)
    kt = first * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    exps = tl.load(s_rows + kt[None, :], mask=(kt * 32 < K)[None, :], other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(blocks):
        k = (first + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_in = (k < K) | EVEN_K
        x = tl.load(x_rows + k[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
        codes = tl.load(w_rows + k[None, :], mask=k_in[None, :], other=0)
        # the next block's scales now, used one iteration later: a byte gather is no cp.async candidate, and
        # loaded where it is used it stalls every iteration for a memory latency (the last one reloads itself)
        kt = (first + tl.minimum(i + 1, blocks - 1)) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        next_exps = tl.load(s_rows + kt[None, :], mask=(kt * 32 < K)[None, :], other=0)
        w = _e4m3_bf16(codes, exps, PTX)
        acc += _dot(x, tl.trans(w), FP32_DOT)
        exps = next_exps
    out = m[:, None] * N + n[None, :]
    if PARTIAL:
        # int64: splits x rows x outputs passes 2^31 (32 x 4096 x 25600 in bench_native)
        tl.store(out_ptr + split.to(tl.int64) * M * N + out, acc, mask=m_in[:, None])
    else:
        tl.store(out_ptr + out, acc.to(tl.bfloat16), mask=m_in[:, None])


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, numel, splits, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out (bf16) = the fp32 partials [splits, numel] added in split order: one launch, deterministic."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(partial_ptr + s * numel.to(tl.int64) + i, mask=inside, other=0.0)  # as the partials' store
    tl.store(out_ptr + i, acc.to(tl.bfloat16), mask=inside)


def block_n_for(n_per_group: int) -> int:
    return 64 if n_per_group % 64 == 0 else 32


def kernel_fits(x, weight, scale, groups) -> bool:
    """The inputs this kernel takes (else the op runs its reference): at most MAX_ROWS rows of bf16
    activations, an E4M3 weight whose groups hold a multiple of 32 outputs (so an output block never
    straddles two groups)."""
    return (x.dtype == torch.bfloat16 and x.numel() <= MAX_ROWS * x.shape[-1] and weight.dtype == torch.float8_e4m3fn
            and weight.dim() == 2
            and scale.dtype == torch.float8_e8m0fnu and groups >= 1 and weight.shape[0] % groups == 0
            and (weight.shape[0] // groups) % 32 == 0 and x.shape[-1] == groups * weight.shape[1])


def default_splits(tiles: int, k_blocks: int, device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """K splits that bring the (token block, output block) tiles up to about programs_per_sm per SM."""
    return max(1, min(k_blocks, programs_per_sm * _num_sms(device) // tiles))


def fp8_block_linear_triton(x, weight, scale, groups=1, splits=None, block_m=None, block_n=None,
                            block_k=BLOCK_K, num_warps=4, num_stages=NUM_STAGES, ptx=None,
                            programs_per_sm=PROGRAMS_PER_SM):
    """bf16 [..., N] as the reference. splits / block sizes / warps / stages / the conversion (ptx: None is the
    module's PTX flag, on CUDA up to PTX_MAX_ROWS rows) / the programs per SM that the default splits aim at:
    for sweeps."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    (m, _), (n, k) = rows.shape, weight.shape
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    on_gpu = x.device.type == "cuda"
    block_m = block_m or (16 if m <= 16 else 64)
    block_n = block_n or block_n_for(n // groups)
    assert (n // groups) % block_n == 0, "an output block must not straddle groups (the kernel has no row mask)"
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    per_split = triton.cdiv(k_blocks, splits or default_splits(tiles, k_blocks, x.device, programs_per_sm))
    splits = triton.cdiv(k_blocks, per_split)  # no split left without columns
    out = x.new_empty(m, n)
    partial = x.new_empty(splits, m, n, dtype=torch.float32) if splits > 1 else out
    _fp8_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)](
        rows, weight.view(torch.uint8), scale.view(torch.uint8), partial, m, n, k, rows.stride(0), n // groups,
        per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=splits > 1, FP32_DOT=not on_gpu,
        PTX=on_gpu and PTX and m <= PTX_MAX_ROWS if ptx is None else ptx, EVEN_K=k % block_k == 0, num_warps=num_warps,
        num_stages=num_stages, **launch_options(x.device))
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](partial, out, m * n, splits, BLOCK=SUM_BLOCK,
                                                             **launch_options(x.device))
    return out.view(*x.shape[:-1], n)
