"""What a prefix-cache hit restores into a cache row (SWA bounded replay, encoder side; SYSTEM.md).

A prefix of H tokens is kept as each KV source's compressed rows and index keys below H, as stored
(records); never the window rings. Restoring it sets the row up to replay tokens [H - W, H) through every
layer (`DeepseekV41Model.run(..., replay_from=H)`): the rings are rebuilt from those W tokens, whose window
sees nothing below H - W, and the restored rows are not rewritten. The rest of the prompt follows in the
same forward. H must be a multiple of every compression ratio (no compressor group left open at H or at
H - W: the window is a multiple of the ratios too) and longer than the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cache import DeepseekV41Cache


@dataclass
class PrefixState:
    length: int  # H: tokens of the prefix
    compressed: dict[int, torch.Tensor]  # KV source layer -> its first H // ratio rows (records)
    index_keys: dict[int, torch.Tensor]  # KV source layer -> the same rows' index keys (records)

    def truncated(self, length: int) -> PrefixState:
        """The state of the first `length` tokens (views: the first rows are the shorter prefix's)."""
        def cut(rows):
            return {layer: t[:t.shape[0] * length // self.length] for layer, t in rows.items()}
        return PrefixState(length, cut(self.compressed), cut(self.index_keys))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.compressed.values(), *self.index_keys.values()))


def alignment(config) -> int:
    """Prefix lengths must be multiples of this (a DeepseekV41TextConfig's compression ratios)."""
    return math.lcm(*(role.ratio for role in config.layer_roles if role.is_kv_source), 1)


def _check_length(cache: DeepseekV41Cache, length: int) -> None:
    if length % alignment(cache.config) or length <= cache.window_size:
        raise ValueError(f"prefix length {length}: must be a multiple of {alignment(cache.config)} (the compression "
                         f"ratios) and longer than the window ({cache.window_size})")


def snapshot(cache: DeepseekV41Cache, row: int, length: int) -> PrefixState:
    """Copy of row `row`'s state for its first `length` tokens (the row must hold at least that many)."""
    _check_length(cache, length)
    held = int(cache.lengths[row])
    if held < length:
        raise ValueError(f"prefix length {length}: row {row} holds only {held} tokens")
    ratios = {role.layer: role.ratio for role in cache.config.layer_roles if role.is_kv_source}
    return PrefixState(length, {layer: cache.compressed[layer][row, :length // r].clone() for layer, r in ratios.items()},
                       {layer: cache.index_keys[layer][row, :length // r].clone() for layer, r in ratios.items()})


def restore(cache: DeepseekV41Cache, row: int, state: PrefixState, engram_history: torch.Tensor) -> None:
    """Put `state` into row `row` as it must be before `run(..., replay_from=state.length)` replays from
    H - W: the restored rows, no open compressor group, the row's length H - W, and `engram_history` (the
    compressed ids of the tokens just before H - W, as the cache keeps them). The rings are left as they
    are: the replay's window floor hides them."""
    _check_length(cache, state.length)
    for layer, rows in state.compressed.items():
        cache.compressed[layer][row, :rows.shape[0]].copy_(rows)
        cache.index_keys[layer][row, :rows.shape[0]].copy_(state.index_keys[layer])
    for layer in cache.pending_kv:
        cache.pending_kv[layer][row].zero_()
        cache.pending_score[layer][row].fill_(-torch.inf)
    cache.engram_history[row].copy_(engram_history)
    cache.lengths[row] = state.length - cache.window_size
