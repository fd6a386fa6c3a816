"""Per-forward bookkeeping shared by every layer: positions, window key lists, visibility, published top-k.

A forward processes a chunk [B, S] of new columns. Left padding (attention_mask 0) gives position -1:
a padded column writes nothing, is no key for anyone and its outputs are discarded. Real tokens of a row
continue from `cache.lengths[b]`. Everything here is computed once per forward, not per layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .cache import DeepseekV41Cache
from .rope import rotation


class GroupRows(NamedTuple):
    """Where a chunk's tokens fall in the compressed rows of one ratio (MODEL.md 4.1). The context's alone, so
    every KV source of the ratio shares it (ForwardContext.group_rows)."""
    # ratio > 1: [B, groups * ratio] the chunk column each slot of the pooling buffer takes (-1: none). The buffer
    # starts at the row's first open group, whose first lengths_before % ratio slots are cached (pending)
    source: torch.Tensor | None
    complete: torch.Tensor | None  # ratio > 1: [B] groups the chunk closes, from the row's first open group
    row_ids: torch.Tensor  # [B, groups] the row each group writes: -1 for none (still open, or below write_floor)
    rot: torch.Tensor  # fp32 (cos, sin) [B, groups, r/2, 2] at each written row's first position


@dataclass
class ForwardContext:
    cache: DeepseekV41Cache
    positions: torch.Tensor  # [B, S] int64, -1 for padding
    lengths_before: torch.Tensor  # [B] real tokens cached before this chunk
    window_idx: torch.Tensor  # [B, S, W] int32: < W ring slot, >= W row W+i of this chunk's kv; -1 = none
    window_slots: torch.Tensor  # [B, S] ring slot each new kv goes to; -1 = not written
    columns_after: int  # host-side bound on any row's length after this chunk (sizes the score rows)
    inv_freq: dict = field(default_factory=dict)  # rope kind ('window' / 'compressed') -> fp32 [r/2]
    rotations: dict = field(default_factory=dict)  # rope kind -> fp32 (cos, sin) [B, S, r/2, 2] at `positions`
    topk: dict = field(default_factory=dict)  # index-source layer -> int32 [B, S, k]
    candidates: torch.Tensor | None = None  # int32 [B, S, blocks]: block ids the candidate source kept
    # [B] positions below which a row's compressed rows and index keys are already in the cache and stay
    # as they are (a prefix-cache hit replays tokens below it only to rebuild the window rings); None: all
    write_floor: torch.Tensor | None = None
    shared_rows: dict = field(default_factory=dict)  # ratio -> GroupRows (group_rows)
    visible_rows: dict = field(default_factory=dict)  # ratio -> [B, S] (visible)

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    def visible(self, ratio: int) -> torch.Tensor:
        """[B, S] compressed rows visible to each query: row j iff j < (p + 1) // ratio (0 for padding). Made once a
        forward (DeepseekV41Model.begin, for every ratio with an index source) and read by each index source: made
        in the layer, a B1 decode step computed it twice an index layer in kernels of its own (12-04 d5 trace)."""
        if ratio not in self.visible_rows:
            self.visible_rows[ratio] = torch.where(self.positions >= 0, (self.positions + 1) // ratio, 0)
        return self.visible_rows[ratio]

    def num_rows(self, ratio: int) -> int:
        """Host-side width of the score rows for this ratio (>= every query's visible count)."""
        return self.columns_after // ratio

    def group_rows(self, ratio: int) -> GroupRows:
        """The chunk's compressed rows at `ratio`, computed once a forward (DeepseekV41Model.begin, for every
        ratio with a KV source) and read by each source (a decode step's 3 ratio-2 sources then lay out and
        rotate their rows once)."""
        if ratio not in self.shared_rows:
            self.shared_rows[ratio] = self._group_rows(ratio)
        return self.shared_rows[ratio]

    def _group_rows(self, ratio: int) -> GroupRows:
        if ratio == 1:  # a row per token at its position: the queries' own rotation
            source = complete = None
            row_ids, rot = self.positions, self.rotations["compressed"]
        else:  # the real tokens (after the left padding) continue the open group's cached slots
            seq = self.positions.shape[1]
            first_group, cached = self.lengths_before // ratio, self.lengths_before % ratio
            real = (self.positions >= 0).sum(1)
            width = ratio + seq + (-seq % ratio)
            column = torch.arange(width, device=real.device) - (cached - (seq - real)).unsqueeze(1)
            source = torch.where((column >= seq - real.unsqueeze(1)) & (column < seq), column, -1)
            complete = (self.lengths_before + real) // ratio - first_group
            group_ids = torch.arange(width // ratio, device=real.device)
            row_ids = torch.where(group_ids < complete.unsqueeze(1), first_group.unsqueeze(1) + group_ids, -1)
            rot = rotation(row_ids.clamp_min(0) * ratio, self.inv_freq["compressed"])
        if self.write_floor is not None:  # rows of a restored prefix keep their cached values
            row_ids = torch.where(row_ids < (self.write_floor // ratio).unsqueeze(1), -1, row_ids)
        return GroupRows(source, complete, row_ids, rot)

    def last_columns(self, columns: int) -> ForwardContext:
        """The context of queries at this chunk's last `columns` columns only, with the keys, window lists and
        cache writes of the whole chunk (a window index past the ring still names a row of the whole chunk's
        kv): what the last KV source's query side runs on under bounded replay."""
        # contiguous: the compiled graphs then see the same strides as from a context built for those columns
        return dataclasses.replace(
            self, positions=self.positions[:, -columns:].contiguous(),
            window_idx=self.window_idx[:, -columns:].contiguous(),
            window_slots=self.window_slots[:, -columns:].contiguous(),
            rotations={kind: rot[:, -columns:].contiguous() for kind, rot in self.rotations.items()},
            topk={layer: topk[:, -columns:].contiguous() for layer, topk in self.topk.items()},
            candidates=None if self.candidates is None else self.candidates[:, -columns:].contiguous(),
            shared_rows={},  # (the whole chunk's: no KV source runs on the last columns alone)
            visible_rows={ratio: v[:, -columns:].contiguous() for ratio, v in self.visible_rows.items()})


def check_left_padding(attention_mask: torch.Tensor) -> None:
    """Padding must be on the left of every row (a host sync: callers run it outside captured graphs)."""
    if attention_mask.shape[1] > 1 and bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
        raise ValueError("attention_mask: padding must be on the left (a 0 follows a 1 in some row); "
                         "pad prompts on the left (tokenizer padding_side='left')")


def build_context(cache: DeepseekV41Cache, attention_mask: torch.Tensor, columns_after: int,
                  window_floor: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> ForwardContext:
    """attention_mask [B, S] (1 = real token) for the new columns only; padding on the left (checked by
    `check_left_padding`). columns_after: a host-side bound on every row's length after this chunk; the
    eager path passes the exact count, compiled graphs pass the cache's max_length so shapes stay static
    (rows beyond a query's visible count score -inf and are never picked, so the outputs are the same).
    window_floor [B]: the lowest position a row's window attention may see (bounded replay clamps the
    window of the trimmed / replayed tokens there); default 0. lengths [B]: real tokens before these
    columns (default: the cache's). No host syncs."""
    mask = attention_mask.to(torch.long)
    batch, seq = mask.shape
    lengths = cache.lengths[:batch] if lengths is None else lengths
    positions = torch.where(mask.bool(), lengths.unsqueeze(1) + mask.cumsum(1) - 1, -1)
    count = mask.sum(1)
    pad = seq - count  # left padding inside this chunk
    window = cache.window_size

    # Window keys of the query at position p: positions max(0, p-W+1) + k, k < W (oldest first), those
    # <= p valid. A key before this chunk lives in ring slot pos % W, a key of this chunk after the ring.
    start = (positions - window + 1).clamp_min(0).unsqueeze(-1)
    key_pos = start + torch.arange(window, device=mask.device)
    in_ring = key_pos < lengths.view(batch, 1, 1)
    idx = torch.where(in_ring, key_pos % window, window + key_pos - lengths.view(batch, 1, 1) + pad.view(batch, 1, 1))
    valid = (key_pos <= positions.unsqueeze(-1)) & (positions.unsqueeze(-1) >= 0)
    if window_floor is not None:
        valid &= key_pos >= window_floor.view(batch, 1, 1)
    window_idx = torch.where(valid, idx, -1).to(torch.int32)  # int32: what the attention kernel reads

    # Only the last W tokens of a row reach the ring; earlier ones would be overwritten in this chunk.
    last = (lengths + count - 1).unsqueeze(1)
    window_slots = torch.where((positions >= 0) & (positions > last - window), positions % window, -1)
    return ForwardContext(cache=cache, positions=positions, lengths_before=lengths.clone(), window_idx=window_idx,
                          window_slots=window_slots, columns_after=columns_after)


def tail_context(ctx: ForwardContext, attention_mask: torch.Tensor, columns: int) -> ForwardContext:
    """The context of the last `columns` columns of ctx's chunk for the layers bounded replay trims
    (SYSTEM.md): the same positions, window lists that see nothing below each row's first tail token,
    and the rotations, top-k and candidates published so far, cut to those columns."""
    mask = attention_mask.to(torch.long)
    first = ctx.lengths_before + mask[:, :-columns].sum(1)  # each row's first tail position
    tail = build_context(ctx.cache, mask[:, -columns:], ctx.columns_after, window_floor=first, lengths=first)
    last = ctx.last_columns(columns)
    tail.inv_freq, tail.rotations, tail.topk, tail.candidates = last.inv_freq, last.rotations, last.topk, last.candidates
    tail.visible_rows = last.visible_rows  # the tail's positions are the chunk's last columns'
    return tail
