"""Static, preallocated per-sequence state (MODEL.md section 7) behind Hugging Face's `Cache` interface.

Sizes are fixed at creation (`max_batch`, `max_length`); forwards only write into the tensors, never
reallocate them, so the cache can live inside CUDA graphs. Per row it holds:
  - `window[L]`        [Bmax, W, d]        every layer's ring (slot = position mod W)
  - `compressed[L]`    [Bmax, Rmax, d]     KV sources: compressed KV rows (Rmax = max_length // ratio)
  - `index_keys[L]`    [Bmax, Rmax, Di]    KV sources: indexer keys
  - `pending_kv[L]`, `pending_score[L]` [Bmax, ratio, d] fp32   ratio > 1 sources: the group still filling
    (slot = position mod ratio; empty slots hold 0 / -inf)
  - `engram_history`   [Bmax, n-1] int64   compressed ids of the last n-1 tokens (pad id at the start)
  - `lengths`          [Bmax] int64        real tokens processed per row (positions continue from here)
Storage is bf16 for the KV kinds; the kernel issue adds FP8/NVFP4/MXFP4 records behind this interface.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .configuration_deepseek_v41 import DeepseekV41TextConfig


class CacheCapacityError(ValueError):
    """A forward does not fit the cache (batch or length); the message names the limit."""


class DeepseekV41Cache(Cache):
    is_compileable = False  # generate() must not build 4D masks or auto-compile around it
    is_sliding = False

    def __init__(self, config: DeepseekV41TextConfig, max_batch: int, max_length: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__(layers=[])
        if max_batch < 1 or max_length < 1:
            raise CacheCapacityError(f"max_batch ({max_batch}) and max_length ({max_length}) must be >= 1")
        self.config = config
        self.max_batch, self.max_length = max_batch, max_length
        self.window_size = config.sliding_window
        d, di = config.head_dim, config.index_head_dim
        kw = dict(device=device, dtype=dtype)
        self.window: dict[int, torch.Tensor] = {}
        self.compressed: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        self.pending_kv: dict[int, torch.Tensor] = {}
        self.pending_score: dict[int, torch.Tensor] = {}
        for role in config.layer_roles:
            self.window[role.layer] = torch.zeros(max_batch, self.window_size, d, **kw)
            if role.is_kv_source:
                rows = max_length // role.ratio
                self.compressed[role.layer] = torch.zeros(max_batch, rows, d, **kw)
                self.index_keys[role.layer] = torch.zeros(max_batch, rows, di, **kw)
                if role.ratio > 1:
                    self.pending_kv[role.layer] = torch.zeros(max_batch, role.ratio, d, device=device)
                    self.pending_score[role.layer] = torch.full((max_batch, role.ratio, d), -torch.inf,
                                                                device=device)
        history = max(config.engram_max_ngram_size - 1, 0)
        self.engram_history = torch.zeros(max_batch, history, dtype=torch.long, device=device)
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.seen_columns = 0  # input columns consumed so far (padding included); host-side
        self.engram_pad_id = 0  # set by the model (compressed id of engram_pad_token_id)
        self.last_index_key_writer: int | None = None  # only for emulate_reference_index_key_pointer
        self.reset()

    # -- Hugging Face Cache interface ---------------------------------------------------------------
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.seen_columns

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_length

    def get_max_length(self) -> int:
        return self.max_length

    @property
    def is_linear(self) -> list[bool]:
        return [False]

    def __len__(self) -> int:
        return self.config.num_hidden_layers

    def __repr__(self) -> str:
        return f"DeepseekV41Cache(max_batch={self.max_batch}, max_length={self.max_length}, seen={self.seen_columns})"

    # -- ours --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty every row in place (tensors keep their storage, so captured graphs stay valid)."""
        for t in (*self.window.values(), *self.compressed.values(), *self.index_keys.values(),
                  *self.pending_kv.values()):
            t.zero_()
        for t in self.pending_score.values():
            t.fill_(-torch.inf)
        self.engram_history.fill_(self.engram_pad_id)
        self.lengths.zero_()
        self.seen_columns = 0
        self.last_index_key_writer = None

    def set_engram_pad_id(self, pad_id: int) -> None:
        self.engram_pad_id = int(pad_id)
        if self.seen_columns == 0:
            self.engram_history.fill_(self.engram_pad_id)

    def check_fits(self, batch: int, new_columns: int) -> None:
        if batch > self.max_batch:
            raise CacheCapacityError(f"batch of {batch} rows exceeds the cache's max_batch={self.max_batch}")
        if self.seen_columns + new_columns > self.max_length:
            raise CacheCapacityError(
                f"sequence of {self.seen_columns + new_columns} positions ({self.seen_columns} cached + "
                f"{new_columns} new) exceeds the cache's max_length={self.max_length}")

    def memory_bytes(self) -> int:
        tensors = [*self.window.values(), *self.compressed.values(), *self.index_keys.values(),
                   *self.pending_kv.values(), *self.pending_score.values(), self.engram_history, self.lengths]
        return sum(t.numel() * t.element_size() for t in tensors)
