"""The ratio > 1 compressor's softmax pooling (MODEL.md 4.1) of a chunk's groups, the open group's cached slots
included: the model's (attention.Compressor) and dsflash::compress_token_'s reference."""

import torch
import torch.nn.functional as F


def softmax_pool(kv: torch.Tensor, score: torch.Tensor, source: torch.Tensor, complete: torch.Tensor,
                 pending_kv: torch.Tensor, pending_score: torch.Tensor) -> torch.Tensor:
    """Per channel, a softmax over each group's r tokens of `score` weights `kv` (fp32 [B, S, d], the chunk's
    projections). source [B, groups * r] and complete [B] lay the groups out (context.GroupRows); pending_kv /
    pending_score fp32 [Bmax, r, d] hold each row's open group (empty slots 0 / -inf) and are updated in place to the
    group left open. Returns fp32 [B, groups, d], rows of groups still open 0."""
    r, batch = pending_kv.shape[1], kv.shape[0]
    # The row's buffer from its first open group: each slot the chunk's token source names, else the pending group
    # as cached, past it empty. Gathered, not scattered: a compiled step reads the tokens where it pools them.
    width = source.shape[1]
    taken = (source >= 0).unsqueeze(-1)
    column = source.clamp_min(0).unsqueeze(-1).expand(-1, -1, kv.shape[-1])
    buf_kv = torch.where(taken, kv.gather(1, column), F.pad(pending_kv[:batch], (0, 0, 0, width - r)))
    buf_score = torch.where(taken, score.gather(1, column),
                            F.pad(pending_score[:batch], (0, 0, 0, width - r), value=-torch.inf))
    buf_kv, buf_score = buf_kv.unflatten(1, (-1, r)), buf_score.unflatten(1, (-1, r))

    pooled = (buf_kv * buf_score.softmax(dim=2)).sum(dim=2)  # [B, groups, d]
    done = torch.arange(pooled.shape[1], device=kv.device) < complete.unsqueeze(1)
    pooled = torch.where(done.unsqueeze(-1), pooled, 0.0)

    # The group left open becomes the new pending state (its empty slots 0 / -inf).
    open_group = complete.view(batch, 1, 1, 1).expand(-1, 1, r, kv.shape[-1])
    pending_kv[:batch] = buf_kv.gather(1, open_group).squeeze(1)
    pending_score[:batch] = buf_score.gather(1, open_group).squeeze(1)
    return pooled
