"""Lightning-indexer ops (MODEL.md section 4.2): scores, candidate blocks.

`dsflash::indexer_scores`: I[b, t, j] = sum_h w[b, t, h] * relu(q[b, t, h] . k[b, j]) over the first
`num_rows` key rows, -inf where row j is not yet visible to query t (j >= visible[b, t]); keys are bf16
rows or records of `fmt` (the cache's own MXFP4 records are read as they are). Reference numerics: the
q.k products and the head sum in bf16, as the release computes them (the scores it ranks are bf16, so
equal scores do occur).

`dsflash::candidate_blocks`: level one of the two-level selection. Blocks of `block_size` rows score
their max, the block holding the query's newest visible row is pinned, the `topk_blocks` best blocks
with a score > -inf are kept; published compactly as block ids per query (not a mask over the context).

`dsflash::candidate_scores` + `dsflash::candidate_topk`: level two scores only those candidate rows, in a
compact [B, S, topk_blocks * block_size] layout, and picks its top-k there, remapped to row ids.

On CUDA each op runs its Triton kernels (indexer_triton.py, topk_triton.py), the same results as the
reference (scores within bf16 rounding-order differences, top-k picks exactly); the CPU path is the
reference. Inputs outside the kernels' scope (q or weights not bf16, a head dim that is not a power of
two >= 32, another key format) take the reference on CUDA too.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from . import records
from .topk import top_k_stable


def indexer_scores_reference(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, num_rows: int) -> Tensor:
    scores = torch.einsum("bshd,btd->bsht", q, keys[:, :num_rows].to(q.dtype))
    scores = (scores.relu() * weights.unsqueeze(-1)).sum(dim=2)
    hidden = torch.arange(num_rows, device=q.device) >= visible.unsqueeze(-1)
    return scores.masked_fill(hidden, -torch.inf)


def _indexer_scores_decoding(q, weights, keys, visible, num_rows, fmt):
    """The reference on the decoded rows of records (bf16 keys as they are)."""
    if fmt == "bf16" and not keys.is_floating_point():
        raise ValueError(f"indexer_scores: fmt 'bf16' needs floating-point key rows, got {keys.dtype} (records "
                         "need their format, e.g. 'mxfp4')")
    if fmt != "bf16":
        keys = records.decode_reference(keys[:, :num_rows], fmt, q.shape[-1])
    return indexer_scores_reference(q, weights, keys, visible, num_rows)


@torch.library.custom_op("dsflash::indexer_scores", mutates_args=())
def indexer_scores(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, num_rows: int,
                   fmt: str = "bf16") -> Tensor:
    """q [B, S, H, D] bf16; weights [B, S, H]; keys [B, R, D] bf16 or records of `fmt` [B, R, bytes]
    (R >= num_rows); visible [B, S] int64. Returns [B, S, num_rows] in q's dtype."""
    return _indexer_scores_decoding(q, weights, keys, visible, num_rows, fmt)


@indexer_scores.register_fake
def _(q, weights, keys, visible, num_rows, fmt="bf16"):
    return q.new_empty(q.shape[0], q.shape[1], num_rows)


def candidate_blocks_reference(scores: Tensor, visible: Tensor, topk_blocks: int, block_size: int) -> Tensor:
    width = scores.shape[-1]
    blocks = F.pad(scores, (0, -width % block_size), value=-torch.inf).unflatten(-1, (-1, block_size)).amax(-1)
    newest = (visible.unsqueeze(-1) - 1).div(block_size, rounding_mode="floor")
    blocks = blocks.masked_fill(torch.arange(blocks.shape[-1], device=scores.device) == newest, torch.inf)
    values, ids = top_k_stable(blocks, min(topk_blocks, blocks.shape[-1]))
    ids = torch.where(values > -torch.inf, ids, blocks.shape[-1])  # dropped picks sort last
    ids = ids.sort(dim=-1).values
    return torch.where(ids < blocks.shape[-1], ids, -1).to(torch.int32)


@torch.library.custom_op("dsflash::candidate_blocks", mutates_args=())
def candidate_blocks(scores: Tensor, visible: Tensor, topk_blocks: int, block_size: int) -> Tensor:
    """Level one: scores [B, S, R] (-inf = not visible); visible [B, S]. Returns the kept block ids
    int32 [B, S, min(topk_blocks, ceil(R / block_size))], ascending, -1 after the last kept block."""
    return candidate_blocks_reference(scores, visible, topk_blocks, block_size)


@candidate_blocks.register_fake
def _(scores, visible, topk_blocks, block_size):
    blocks = -(-scores.shape[-1] // block_size)
    return scores.new_empty(*scores.shape[:-1], min(topk_blocks, blocks), dtype=torch.int32)


def candidate_rows(blocks: Tensor, block_size: int) -> Tensor:
    """Block ids [B, S, nb] -> the rows they cover [B, S, nb * block_size] (-1 where the block is -1)."""
    rows = blocks.unsqueeze(-1).long() * block_size + torch.arange(block_size, device=blocks.device)
    return torch.where(blocks.unsqueeze(-1) >= 0, rows, -1).flatten(-2)


def candidate_scores_reference(q: Tensor, weights: Tensor, keys: Tensor, blocks: Tensor, block_size: int,
                               visible: Tensor, fmt: str) -> Tensor:
    rows = candidate_rows(blocks, block_size)
    ok = (rows >= 0) & (rows < visible.unsqueeze(-1))
    batch = q.shape[0]
    picked = keys[torch.arange(batch, device=q.device).view(batch, 1, 1), rows.clamp(0, keys.shape[1] - 1)]
    if fmt != "bf16":
        picked = records.decode_reference(picked, fmt, q.shape[-1])
    scores = torch.einsum("bshd,bscd->bshc", q, picked.to(q.dtype))
    scores = (scores.relu() * weights.unsqueeze(-1)).sum(dim=2)
    return scores.masked_fill(~ok, -torch.inf)


@torch.library.custom_op("dsflash::candidate_scores", mutates_args=())
def candidate_scores(q: Tensor, weights: Tensor, keys: Tensor, blocks: Tensor, block_size: int, visible: Tensor,
                     fmt: str) -> Tensor:
    """Level two, candidate-only: the indexer score of each candidate row only, in the compact layout
    [B, S, nb * block_size] (column c = row blocks[c // bs] * bs + c % bs), -inf where that row is
    not visible or its block is -1. keys [B, R, D] bf16 or records of `fmt` (e.g. "mxfp4", 68 B rows)."""
    return candidate_scores_reference(q, weights, keys, blocks, block_size, visible, fmt)


@candidate_scores.register_fake
def _(q, weights, keys, blocks, block_size, visible, fmt):
    return q.new_empty(q.shape[0], q.shape[1], blocks.shape[-1] * block_size)


def candidate_topk_reference(scores: Tensor, blocks: Tensor, block_size: int, k: int) -> Tensor:
    values, picks = top_k_stable(scores, k)
    rows = candidate_rows(blocks, block_size).gather(-1, picks)
    rows = torch.where(values > -torch.inf, rows, torch.iinfo(torch.int32).max).sort(dim=-1).values
    return torch.where(rows < torch.iinfo(torch.int32).max, rows, -1).to(torch.int32)


@torch.library.custom_op("dsflash::candidate_topk", mutates_args=())
def candidate_topk(scores: Tensor, blocks: Tensor, block_size: int, k: int) -> Tensor:
    """Top-k in the compact candidate space, remapped to row ids: int32 [B, S, k], ascending, -1 for
    picks whose score is -inf (fewer than k visible candidates)."""
    return candidate_topk_reference(scores, blocks, block_size, k)


@candidate_topk.register_fake
def _(scores, blocks, block_size, k):
    return scores.new_empty(*scores.shape[:-1], k, dtype=torch.int32)


try:  # Triton is optional on CPU machines
    from . import indexer_triton, topk_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    indexer_triton = None


def _kernels_fit(q: Tensor, weights: Tensor, fmt: str) -> bool:
    dim = q.shape[-1]
    return (q.dtype == weights.dtype == torch.bfloat16 and fmt in indexer_triton.FORMATS and dim >= 32
            and dim & (dim - 1) == 0)


if indexer_triton is not None:
    @indexer_scores.register_kernel("cuda")
    def _(q, weights, keys, visible, num_rows, fmt="bf16"):
        if not _kernels_fit(q, weights, fmt):
            return _indexer_scores_decoding(q, weights, keys, visible, num_rows, fmt)
        return indexer_triton.indexer_scores_triton(q, weights, keys, visible, num_rows, fmt)

    @candidate_blocks.register_kernel("cuda")
    def _(scores, visible, topk_blocks, block_size):
        if scores.dtype not in topk_triton.KEY_DTYPES:
            return candidate_blocks_reference(scores, visible, topk_blocks, block_size)
        return indexer_triton.candidate_blocks_triton(scores, visible, topk_blocks, block_size)

    @candidate_scores.register_kernel("cuda")
    def _(q, weights, keys, blocks, block_size, visible, fmt):
        if not _kernels_fit(q, weights, fmt):
            return candidate_scores_reference(q, weights, keys, blocks, block_size, visible, fmt)
        return indexer_triton.candidate_scores_triton(q, weights, keys, blocks, block_size, visible, fmt)

    @candidate_topk.register_kernel("cuda")
    def _(scores, blocks, block_size, k):
        if scores.dtype not in topk_triton.KEY_DTYPES:
            return candidate_topk_reference(scores, blocks, block_size, k)
        return topk_triton.candidate_topk_triton(scores, blocks, block_size, k)
