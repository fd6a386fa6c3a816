"""`dsflash::token_sum`: each token's expert outputs summed back from MoE's expert-sorted rows, as one op.

    out [P, D]: the grouped GEMMs' rows (pair p's row at rank[p]); ascending [T, k]: each token's slots in
    ascending expert id; pairs ranked at `offsets[-1]` or later (another rank's experts: no GEMM computed their
    rows) add zero
    y[t] = sum over j = 0..k-1 of fp32(out[rank[t k + ascending[t, j]]])   (in that order: the expert loop's)

returned in `dtype` (fp32 for ParallelMoE's reduction, or the model's dtype where the sum is the MoE's output).

Why an op: written with tensors (MoE._routed_grouped's gather and running sum), Inductor computed it in two
kernels a layer after the down GEMM (H200, flash-40l-e8 bf16 decode B64, 12-02 s trace: 4.4 + 5.2 us, grids 640
and 2560), the second fused with the block's closing hc_post. The kernel (token_sum_triton.py) reads each token's
k rows once and stores the result in its dtype; hc_post then runs alone, so the step keeps its kernel count and
gains little: H200 B64 decode 16.75 ms against 16.79 (12-02 t, each round lower, logits equal; 3.9 us a layer on
the critical path). It pays more once the closing hc_post joins the next block's seam. The reference is the
tensor code, which MoE runs eagerly.
"""

import torch
from torch import Tensor


@torch.library.custom_op("dsflash::token_sum", mutates_args=())
def token_sum(out: Tensor, rank: Tensor, ascending: Tensor, offsets: Tensor, dtype: torch.dtype) -> Tensor:
    """out [P, D] float; rank int64 [T k]; ascending int64 [T, k]; offsets int32 [G] (the GEMMs' row offsets).
    Returns [T, D] in dtype."""
    return token_sum_reference(out, rank, ascending, offsets, dtype)


def check_inputs(out, rank, ascending, offsets) -> None:
    """Errors that name the problem."""
    if out.dim() != 2 or ascending.dim() != 2 or rank.dim() != 1 or offsets.dim() != 1:
        raise ValueError(f"token_sum: out [P, D], rank [T k], ascending [T, k] and offsets [G] expected, got "
                         f"{tuple(out.shape)}, {tuple(rank.shape)}, {tuple(ascending.shape)}, {tuple(offsets.shape)}")
    if rank.numel() != ascending.numel() or ascending.shape[1] == 0 or offsets.numel() == 0:
        raise ValueError(f"token_sum: rank has {rank.numel()} pairs, ascending {tuple(ascending.shape)} (at least one "
                         f"slot a token), offsets {offsets.numel()} experts (at least one)")
    if rank.dtype != torch.int64 or ascending.dtype != torch.int64 or offsets.dtype != torch.int32:
        raise TypeError(f"token_sum: rank and ascending must be int64 and offsets int32, got {rank.dtype}, "
                        f"{ascending.dtype} and {offsets.dtype}")
    if not out.is_floating_point():
        raise TypeError(f"token_sum: out must be floating point, got {out.dtype}")


def token_sum_reference(out, rank, ascending, offsets, dtype):
    check_inputs(out, rank, ascending, offsets)
    tokens, k = ascending.shape
    row = rank[ascending + k * torch.arange(tokens, device=out.device).unsqueeze(1)]  # [T, k]
    picked = torch.where((row < offsets[-1]).unsqueeze(-1), out[row], 0.0)  # rows past it: undefined (_grouped_mm)
    y = picked[:, 0].float()
    for j in range(1, k):
        y = y + picked[:, j].float()
    return y.to(dtype)


@token_sum.register_fake
def _(out, rank, ascending, offsets, dtype):
    check_inputs(out, rank, ascending, offsets)
    return out.new_empty((ascending.shape[0], out.shape[1]), dtype=dtype)


try:  # Triton is optional on CPU machines
    from . import token_sum_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    token_sum_triton = None

if token_sum_triton is not None:
    @token_sum.register_kernel("cuda")
    def _(out, rank, ascending, offsets, dtype):
        check_inputs(out, rank, ascending, offsets)
        if not token_sum_triton.kernel_fits(out, dtype):
            return token_sum_reference(out, rank, ascending, offsets, dtype)
        return token_sum_triton.token_sum_triton(out, rank, ascending, offsets, dtype)
