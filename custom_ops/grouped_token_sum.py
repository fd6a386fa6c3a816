"""`dsflash::grouped_token_sum`: the last half of MoE's sorted path (bf16 experts) as one op.

    out = grouped_mm(x, weight, offsets)                 (x [P, K] sorted by expert; rows past offsets[-1] zero)
    y[t] = sum over j of fp32(out[rank[t k + ascending[t, j]]]), j = 0 .. k-1 in order
                                                         (each token's pairs in ascending expert id: the loop's order)

rank [P] is where pair p = t k + s landed in the sorted order; ascending [T, k] lists each token's slots in
ascending expert id (dsflash::expert_order returns both). A pair no expert here takes (id -1: another rank's)
sorts past the last offset, where the GEMM's rows are zero, so it adds nothing.

Why an op: in the compiled decode step (batch 17-64) MoE ran the down projection's grouped GEMM, then two
Inductor kernels for the un-sort and the ordered sum (H200 B64 trace, 12-02 q: 4.0 + 3.7 us a layer and their
gaps). On CUDA this op is one launch (grouped_token_sum_triton.py): the GEMM's programs bump a counter per
column block and the block's last one sums every token's pair rows there, in order (no atomics on y: the same
bits whichever program is last), as routed_experts' down kernel does.

The reference is MoE's own math, for CPU and inputs the kernel does not take.
"""

import torch
from torch import Tensor

from .mxfp4_experts import check_bf16_inputs, grouped_mm_reference


@torch.library.custom_op("dsflash::grouped_token_sum", mutates_args=())
def grouped_token_sum(x: Tensor, weight: Tensor, offsets: Tensor, rank: Tensor, ascending: Tensor) -> Tensor:
    """x bf16 [P, K] sorted by expert; weight bf16 [E, N, K]; offsets int32 [E]; rank int64 [P]; ascending int64
    [T, k] with T k = P. Returns fp32 [T, N]: each token's pair outputs summed in ascending expert id."""
    return grouped_token_sum_reference(x, weight, offsets, rank, ascending)


def check_inputs(x, weight, offsets, rank, ascending) -> None:
    check_bf16_inputs(x, weight, offsets)  # (its messages name grouped_mm, the op's first half)
    if ascending.dim() != 2 or ascending.dtype != torch.int64 or ascending.numel() != x.shape[0]:
        raise ValueError(f"grouped_token_sum: ascending must be int64 [tokens, k] with tokens x k = {x.shape[0]} "
                         f"rows of x, got {ascending.dtype} {tuple(ascending.shape)}")
    if rank.dtype != torch.int64 or tuple(rank.shape) != (x.shape[0],):
        raise ValueError(f"grouped_token_sum: rank must be int64 [{x.shape[0]}] (one per row of x), got "
                         f"{rank.dtype} {tuple(rank.shape)}")


def grouped_token_sum_reference(x, weight, offsets, rank, ascending):
    check_inputs(x, weight, offsets, rank, ascending)
    tokens, k = ascending.shape
    out = grouped_mm_reference(x, weight, offsets)
    picked = out[rank[ascending + k * torch.arange(tokens, device=x.device).unsqueeze(1)]]  # [T, k, N]
    y = picked[:, 0].float()
    for j in range(1, k):
        y = y + picked[:, j].float()
    return y


@grouped_token_sum.register_fake
def _(x, weight, offsets, rank, ascending):
    check_inputs(x, weight, offsets, rank, ascending)
    return x.new_empty(ascending.shape[0], weight.shape[1], dtype=torch.float32)


try:  # Triton is optional on CPU machines
    from . import grouped_token_sum_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    grouped_token_sum_triton = None

if grouped_token_sum_triton is not None:
    @grouped_token_sum.register_kernel("cuda")
    def _(x, weight, offsets, rank, ascending):
        check_inputs(x, weight, offsets, rank, ascending)
        return grouped_token_sum_triton.grouped_token_sum_triton(x, weight, offsets, rank, ascending)
