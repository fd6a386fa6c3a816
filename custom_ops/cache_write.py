"""`dsflash::cache_write_`: scatter new rows into a preallocated per-row cache, in place.

Used for every cache kind (window ring slot = position mod W, compressed KV row, index-key row):
`cache[b, slots[b, t]] = rows[b, t]` wherever `slots[b, t] >= 0`; slot -1 skips the row (padding, or a
token that a later token of the same chunk overwrites). The storage here is the row's dtype family
(bf16/fp32); quantized record formats come with their own write ops.
"""

import torch
from torch import Tensor


def cache_write_reference(cache: Tensor, rows: Tensor, slots: Tensor) -> None:
    b, t = (slots >= 0).nonzero(as_tuple=True)
    cache[b, slots[b, t]] = rows[b, t].to(cache.dtype)


@torch.library.custom_op("dsflash::cache_write_", mutates_args=("cache",))
def cache_write_(cache: Tensor, rows: Tensor, slots: Tensor) -> None:
    """cache [Bmax, N, ...]; rows [B, S, ...] (B <= Bmax); slots [B, S] int64."""
    cache_write_reference(cache, rows, slots)


@cache_write_.register_fake
def _(cache, rows, slots):
    return None
