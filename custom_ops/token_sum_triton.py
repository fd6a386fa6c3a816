"""Triton kernel of `dsflash::token_sum` (see token_sum.py for the math): one program per (token, block of
BLOCK_D columns). A program reads its token's k slots in ascending expert id, each slot's row rank, and adds those
rows' columns in that order in fp32 (the first one assigned, not added to zero, so a -0.0 stays -0.0); rows
ranked at offsets[-1] or later add nothing. bf16 rows widen and a bf16 result rounds by integer arithmetic on the
bits, which the interpreter runs as the GPU does."""

import torch
import triton
import triton.language as tl

from .bf16_bits import _bf16_as_f32, _f32_to_bf16
from .pdl import launch_options, pdl_wait

BLOCK_D = 1024  # B64 at D = 5120: 320 programs, each reading its token's k rows of 2 KB


@triton.jit
def _token_sum_kernel(out_ptr, rank_ptr, ascending_ptr, offsets_ptr, y_ptr, D, G, K: tl.constexpr,
                      KP: tl.constexpr, BLOCK_D: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
                      PDL: tl.constexpr):
    """out [P, D], y [T, D] contiguous; rank [T K], ascending [T, K] int64; offsets [G] int32."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = d < D
    computed = tl.load(offsets_ptr + G - 1)
    # the token's rows first (two vector loads), so that its K row loads below are independent of each other
    slot = tl.arange(0, KP)
    rows = tl.load(rank_ptr + t * K + tl.load(ascending_ptr + t * K + slot, mask=slot < K, other=0), mask=slot < K,
                   other=0)
    for j in tl.static_range(K):
        row = tl.sum(tl.where(slot == j, rows, 0))
        v = tl.load(out_ptr + row * D + d, mask=in_d & (row < computed), other=0.0)
        v = _bf16_as_f32(v) if IN_BF16 else v.to(tl.float32)
        if j == 0:
            y = v
        else:
            y = y + v
    tl.store(y_ptr + t * D + d, _f32_to_bf16(y) if OUT_BF16 else y, mask=in_d)


def kernel_fits(out, dtype) -> bool:
    """bf16 or fp32 rows and result (else the op runs its reference)."""
    return out.dtype in (torch.bfloat16, torch.float32) and dtype in (torch.bfloat16, torch.float32)


def token_sum_triton(out, rank, ascending, offsets, dtype):
    """[T, D] in dtype, as the reference."""
    tokens, k = ascending.shape
    dim = out.shape[1]
    y = out.new_empty((tokens, dim), dtype=dtype)
    if tokens and dim:
        _token_sum_kernel[(tokens, triton.cdiv(dim, BLOCK_D))](
            out.contiguous(), rank.contiguous(), ascending.contiguous(), offsets.contiguous(), y, dim,
            offsets.numel(), K=k, KP=triton.next_power_of_2(k), BLOCK_D=BLOCK_D, IN_BF16=out.dtype == torch.bfloat16,
            OUT_BF16=dtype == torch.bfloat16, num_warps=4, **launch_options(out.device))
    return y
