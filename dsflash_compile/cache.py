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
Each KV kind is stored in a record format (custom_ops/records.py): `window_format` "fp8" (528 B/slot) or
"bf16"; `compressed_format` "nvfp4" (288 B/row) or "bf16" (1024); `index_format` "mxfp4"
(68 B/row) or "bf16". "auto" picks fp8 / nvfp4 / mxfp4 on CUDA and bf16 on the CPU (where the codecs
work too, only slower). The model quantize-dequantizes to exactly these grids, so the format changes no
output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .configuration_deepseek_v41 import DeepseekV41TextConfig
from .custom_ops import records

# An FP8 record (UE8M0 scales) cannot hold NVFP4-grid values exactly, so FP8 compressed rows exist only
# for the attention benchmark's comparison, not as a cache format.
_ALLOWED = {"window": ("fp8", "bf16"), "compressed": ("nvfp4", "bf16"), "index": ("mxfp4", "bf16")}
CUDA_CACHE_FORMATS = {"window": "fp8", "compressed": "nvfp4", "index": "mxfp4"}  # "auto" on CUDA


def resolve_format(kind: str, fmt: str, device) -> str:
    if fmt == "auto":
        return CUDA_CACHE_FORMATS[kind] if torch.device(device or "cpu").type == "cuda" else "bf16"
    if fmt not in _ALLOWED[kind]:
        raise ValueError(f"{kind}_format={fmt!r}: choose one of {', '.join(_ALLOWED[kind])} or 'auto'")
    return fmt


def growing_bytes_per_token(config: DeepseekV41TextConfig, compressed_format: str = "nvfp4",
                            index_format: str = "mxfp4") -> float:
    """Bytes the cache grows by per token: every KV source adds one compressed row and one index-key row
    per `ratio` tokens (MODEL.md section 7: 890 B for the release with NVFP4 + MXFP4)."""
    row = records.record_bytes(compressed_format, config.head_dim) + records.record_bytes(index_format,
                                                                                           config.index_head_dim)
    return sum(row / role.ratio for role in config.layer_roles if role.is_kv_source)


def _storage(rows: tuple, dim: int, fmt: str, device) -> torch.Tensor:
    if fmt == "bf16":
        return torch.zeros(*rows, dim, dtype=torch.bfloat16, device=device)
    return torch.zeros(*rows, records.record_bytes(fmt, dim), dtype=torch.uint8, device=device)


@dataclass
class LayerCache:
    """The cache tensors one layer reads and writes. Layers get these rather than looking tensors up by
    layer id, so layers of the same role run the same code (one compiled graph serves them all)."""

    window: torch.Tensor  # this layer's ring [Bmax, W, ...]
    compressed: torch.Tensor | None = None  # compressed KV rows of the source it reads (ratio > 0)
    index_keys: torch.Tensor | None = None  # index keys its indexer scores (index sources)
    pending_kv: torch.Tensor | None = None  # its compressor's open group (ratio > 1 KV sources)
    pending_score: torch.Tensor | None = None


class CacheCapacityError(ValueError):
    """A forward does not fit the cache (batch or length); the message names the limit."""


class DeepseekV41Cache(Cache):
    is_compileable = False  # generate() must not build 4D masks or auto-compile around it
    is_sliding = False

    def __init__(self, config: DeepseekV41TextConfig, max_batch: int, max_length: int,
                 device: torch.device | str | None = None, window_format: str = "auto",
                 compressed_format: str = "auto", index_format: str = "auto"):
        super().__init__(layers=[])
        if max_batch < 1 or max_length < 1:
            raise CacheCapacityError(f"max_batch ({max_batch}) and max_length ({max_length}) must be >= 1")
        self.config = config
        self.max_batch, self.max_length = max_batch, max_length
        self.window_size = config.sliding_window
        d, di = config.head_dim, config.index_head_dim
        self.window_format = resolve_format("window", window_format, device)
        self.compressed_format = resolve_format("compressed", compressed_format, device)
        self.index_format = resolve_format("index", index_format, device)
        self.window: dict[int, torch.Tensor] = {}
        self.compressed: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        self.pending_kv: dict[int, torch.Tensor] = {}
        self.pending_score: dict[int, torch.Tensor] = {}
        for role in config.layer_roles:
            self.window[role.layer] = _storage((max_batch, self.window_size), d, self.window_format, device)
            if role.is_kv_source:
                rows = max_length // role.ratio
                self.compressed[role.layer] = _storage((max_batch, rows), d, self.compressed_format, device)
                self.index_keys[role.layer] = _storage((max_batch, rows), di, self.index_format, device)
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

    @property
    def bytes_per_token(self) -> float:
        """Growth of the per-row state per token with this cache's formats (the rings are fixed-size)."""
        return growing_bytes_per_token(self.config, self.compressed_format, self.index_format)

    def read(self, kind: str, layer: int) -> torch.Tensor:
        """A kind's rows decoded to bf16 ([Bmax, N, dim]): for tests and inspection, not the hot path."""
        storage, fmt = {"window": (self.window, self.window_format),
                        "compressed": (self.compressed, self.compressed_format),
                        "index": (self.index_keys, self.index_format)}[kind]
        dim = self.config.index_head_dim if kind == "index" else self.config.head_dim
        return records.decode_reference(storage[layer], fmt, dim) if fmt != "bf16" else storage[layer]

    def layer(self, role) -> LayerCache:
        """What layer `role.layer` reads and writes (see LayerCache)."""
        own = role.layer if role.is_kv_source else None
        return LayerCache(window=self.window[role.layer],
                          compressed=self.compressed[role.kv_layer] if role.ratio else None,
                          index_keys=self.index_keys.get(role.kv_layer) if role.is_index_source else None,
                          pending_kv=self.pending_kv.get(own), pending_score=self.pending_score.get(own))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache (compiled graphs mark them as fixed-address inputs)."""
        return [*self.window.values(), *self.compressed.values(), *self.index_keys.values(),
                *self.pending_kv.values(), *self.pending_score.values(), self.engram_history, self.lengths]

    def save_state(self) -> tuple:
        """A copy of every tensor and of the host-side counters, for restore_state: runs that must leave the
        cache as they found it (a decode graph's warm-up steps; a script replaying steps from one prefill)."""
        return [t.clone() for t in self.tensors()], self.seen_columns, self.last_index_key_writer

    def restore_state(self, state: tuple) -> None:
        """Put back what save_state copied, in place (tensors keep their storage, so captured graphs stay valid)."""
        tensors, self.seen_columns, self.last_index_key_writer = state
        for t, saved in zip(self.tensors(), tensors):
            t.copy_(saved)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
