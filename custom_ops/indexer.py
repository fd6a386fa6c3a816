"""Lightning-indexer ops (MODEL.md section 4.2): scores, candidate blocks.

`dsflash::indexer_scores`: I[b, t, j] = sum_h w[b, t, h] * relu(q[b, t, h] . k[b, j]) over the first
`num_rows` key rows, -inf where row j is not yet visible to query t (j >= visible[b, t]). Reference
numerics: the q.k products and the head sum in bf16, as the release computes them (the scores it ranks
are bf16, so equal scores do occur).

`dsflash::candidate_mask`: level one of the two-level selection. Blocks of `block_size` rows score their
max, the block holding the query's newest visible row is pinned, the `topk_blocks` best blocks with a
score > -inf are kept; returned as a per-row bool mask [B, S, num_rows].
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def indexer_scores_reference(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, num_rows: int) -> Tensor:
    scores = torch.einsum("bshd,btd->bsht", q, keys[:, :num_rows].to(q.dtype))
    scores = (scores.relu() * weights.unsqueeze(-1)).sum(dim=2)
    hidden = torch.arange(num_rows, device=q.device) >= visible.unsqueeze(-1)
    return scores.masked_fill(hidden, -torch.inf)


@torch.library.custom_op("dsflash::indexer_scores", mutates_args=())
def indexer_scores(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, num_rows: int) -> Tensor:
    """q [B, S, H, D] bf16; weights [B, S, H]; keys [B, R, D] (R >= num_rows); visible [B, S] int64.
    Returns [B, S, num_rows] in q's dtype."""
    return indexer_scores_reference(q, weights, keys, visible, num_rows)


@indexer_scores.register_fake
def _(q, weights, keys, visible, num_rows):
    return q.new_empty(q.shape[0], q.shape[1], num_rows)


def candidate_mask_reference(scores: Tensor, visible: Tensor, topk_blocks: int, block_size: int) -> Tensor:
    width = scores.shape[-1]
    blocks = F.pad(scores, (0, -width % block_size), value=-torch.inf).unflatten(-1, (-1, block_size)).amax(-1)
    newest = (visible.unsqueeze(-1) - 1).div(block_size, rounding_mode="floor")
    blocks = blocks.masked_fill(torch.arange(blocks.shape[-1], device=scores.device) == newest, torch.inf)
    top = blocks.topk(min(topk_blocks, blocks.shape[-1]), dim=-1)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > -torch.inf)
    return keep.repeat_interleave(block_size, dim=-1)[..., :width].contiguous()


@torch.library.custom_op("dsflash::candidate_mask", mutates_args=())
def candidate_mask(scores: Tensor, visible: Tensor, topk_blocks: int, block_size: int) -> Tensor:
    """scores [B, S, R] (-inf = not visible); visible [B, S]. Returns bool [B, S, R]."""
    return candidate_mask_reference(scores, visible, topk_blocks, block_size)


@candidate_mask.register_fake
def _(scores, visible, topk_blocks, block_size):
    return torch.empty_like(scores, dtype=torch.bool)
