"""`dsflash::topk_indices`: the indexer's top-k, sorted ascending, -1 for picks that are not visible.

k picks per query among `scores[..., :R]`; a pick j with j >= visible[b, t] (fewer visible rows than k)
becomes -1. Exact score ties at the cut are resolved as torch.topk(sorted=False) resolves them (the
release's choice); callers must not depend on tie order.
"""

import torch
from torch import Tensor


def topk_indices_reference(scores: Tensor, k: int, visible: Tensor) -> Tensor:
    picks = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return torch.where(picks < visible.unsqueeze(-1), picks, -1).to(torch.int32)


@torch.library.custom_op("dsflash::topk_indices", mutates_args=())
def topk_indices(scores: Tensor, k: int, visible: Tensor) -> Tensor:
    """scores [B, S, R]; k <= R; visible [B, S] int64. Returns int32 [B, S, k]."""
    return topk_indices_reference(scores, k, visible)


@topk_indices.register_fake
def _(scores, k, visible):
    return scores.new_empty(*scores.shape[:-1], k, dtype=torch.int32)
