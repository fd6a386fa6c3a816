"""`dsflash::topk_indices`: the indexer's top-k, sorted ascending, -1 for picks that are not visible.

k picks per query among `scores[..., :R]`; a pick j with j >= visible[b, t] (fewer visible rows than k)
becomes -1. Exact score ties at the cut go to the lower index (deterministic; the release's
torch.topk(sorted=False) leaves them implementation-defined, so a tie may resolve differently from it).
On CUDA the op runs the Triton kernels of topk_triton.py (radix, row-wise or filter path, by shape: the
same picks, without a sort of the whole row); the CPU path is the reference.
"""

import torch
from torch import Tensor


def top_k_stable(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, indices) of the k largest along the last dim; an exact tie goes to the lower index, on
    every device and thread count. torch.topk alone leaves ties implementation-defined, so it ranks one
    int64 key per entry: the score's order-preserving fp32 bits above the index's complement."""
    width = scores.shape[-1]
    if width >= 1 << 31:
        raise ValueError(f"top_k_stable: {width} entries per row exceed 2^31")
    bits = scores.float().contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # larger float -> larger integer
    key = (ordered << 31) | ((1 << 31) - 1 - torch.arange(width, device=scores.device))
    indices = key.topk(k, dim=-1).indices
    return scores.gather(-1, indices), indices


def topk_indices_reference(scores: Tensor, k: int, visible: Tensor) -> Tensor:
    picks = top_k_stable(scores, k)[1].sort(dim=-1).values
    return torch.where(picks < visible.unsqueeze(-1), picks, -1).to(torch.int32)


@torch.library.custom_op("dsflash::topk_indices", mutates_args=())
def topk_indices(scores: Tensor, k: int, visible: Tensor) -> Tensor:
    """scores [B, S, R]; k <= R; visible [B, S] int64. Returns int32 [B, S, k]."""
    return topk_indices_reference(scores, k, visible)


@topk_indices.register_fake
def _(scores, k, visible):
    return scores.new_empty(*scores.shape[:-1], k, dtype=torch.int32)


try:  # Triton is optional on CPU machines
    from . import topk_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    topk_triton = None

if topk_triton is not None:
    @topk_indices.register_kernel("cuda")
    def _(scores, k, visible):
        if scores.dtype not in topk_triton.KEY_DTYPES:
            return topk_indices_reference(scores, k, visible)
        return topk_triton.topk_indices_triton(scores, k, visible)
