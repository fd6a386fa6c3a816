"""`dsflash::topk_indices`: the indexer's top-k, sorted ascending, -1 for picks that are not visible.

k picks per query among `scores[..., :R]`; a pick j with j >= visible[b, t] (fewer visible rows than k)
becomes -1. Exact score ties at the cut go to the lower index (deterministic; the release's
torch.topk(sorted=False) leaves them implementation-defined, so a tie may resolve differently from it).
"""

import torch
from torch import Tensor


def top_k_stable(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, indices) of the k largest along the last dim; equal scores keep index order, so exact
    ties resolve deterministically (lowest index wins) on every device and thread count."""
    order = scores.sort(dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


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
