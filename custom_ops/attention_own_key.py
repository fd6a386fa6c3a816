"""`dsflash::attention_own_key_`: a one-token step's attention that makes the token's own key itself (issue 5).

At decode a layer's key row is kv_norm_rope's (RMSNorm, RoPE of the tail, FP8 rounding) of the kv part of its input
projection, written to the window ring and attended as the window list's chunk entry. As a launch of its own
(kv_norm_rope_write_, or qkv_norm_rope_write_ with the query's norm) that row's kernel lies on every layer's path
between the input projection and wq_b (qkv_norm_rope: 2.1 us a layer of the H200's B1 step, 12-05 g3 trace). Here
the attention's programs make the row from the projection (each program its own copy: 512 values), and the token's
first program writes it to the ring after its PDL wait. The query's RMSNorm is left to the model (an Inductor
kernel, or wq_b's prologue: passes/linear_norm.py).

    attention_own_key_(out, ring, q, kv, weight, eps, rot, quantize, slots, widx, compressed, cidx, sink, positions,
                       inv_freq, scale, window_fmt, compressed_fmt)
      ==  key = kv_norm_rope_write_(ring, slots, window_fmt, kv, weight, eps, rot, quantize)
          attention_(out, q, ring[:B], key, widx, compressed, cidx, sink, positions, inv_freq, scale, window_fmt,
                     compressed_fmt)

The ring write and the attention's reads do not meet: the slot the token goes to held the key W positions back,
outside its window (context.build_context names the token's own key as the chunk's row, not its slot).

early: the programs make the row before their PDL wait, beside the kernel before them (wq_b's GEMV), which holds
only where kv was written at least two launches back by kernels that wait before they let the next one start
(pdl.py): the model sets it where wq_a and wkv are one projection, whose launch comes before the query's wq_b.
"""

import torch
from torch import Tensor

from . import records
from .attention import attention_reference
from .kv_norm_rope import check_inputs, kv_norm_rope_reference


def _check(out, ring, q, kv, weight, rot, quantize, slots, window_fmt) -> None:
    """Errors that name the problem (the two ops' checks, and one key row a query)."""
    if kv.shape[:-1] != q.shape[:2] or out.shape != q.shape:
        raise ValueError(f"attention_own_key_: kv {tuple(kv.shape)} must hold one key row a query of q "
                         f"{tuple(q.shape)} (out {tuple(out.shape)}: q's shape)")
    check_inputs(kv, weight, rot, quantize)
    records._check_write(ring, kv, slots, window_fmt)


def attention_own_key_reference(out, ring, q, kv, weight, eps, rot, quantize, slots, widx, compressed, cidx, sink,
                                positions, inv_freq, scale, window_fmt, compressed_fmt) -> None:
    _check(out, ring, q, kv, weight, rot, quantize, slots, window_fmt)
    key = kv_norm_rope_reference(kv, weight, eps, rot, quantize)
    records.record_write_reference(ring, key, slots, window_fmt)
    attention_reference(out, q, ring[:q.shape[0]], key, widx, compressed, cidx, sink, positions, inv_freq, scale,
                        window_fmt, compressed_fmt)


@torch.library.custom_op("dsflash::attention_own_key_", mutates_args=("out", "ring"))
def attention_own_key_(out: Tensor, ring: Tensor, q: Tensor, kv: Tensor, weight: Tensor, eps: float, rot: Tensor,
                       quantize: bool, slots: Tensor, widx: Tensor, compressed: Tensor, cidx: Tensor, sink: Tensor,
                       positions: Tensor, inv_freq: Tensor, scale: float, window_fmt: str, compressed_fmt: str,
                       early: bool = False) -> None:
    """out, q [B, S, H, d]; ring [Bmax, W, record] (window_fmt), written at slots [B, S] as record_write_ writes;
    kv bf16 [B, S, d] (any row stride), weight, eps, rot, quantize: kv_norm_rope's; the rest: attention_'s, whose
    chunk_kv is the key row made here. early: the module notes."""
    attention_own_key_reference(out, ring, q, kv, weight, eps, rot, quantize, slots, widx, compressed, cidx, sink,
                                positions, inv_freq, scale, window_fmt, compressed_fmt)


@attention_own_key_.register_fake
def _(out, ring, q, kv, weight, eps, rot, quantize, slots, widx, compressed, cidx, sink, positions, inv_freq, scale,
      window_fmt, compressed_fmt, early=False):
    _check(out, ring, q, kv, weight, rot, quantize, slots, window_fmt)


try:  # Triton is optional on CPU machines
    from . import attention_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    attention_triton = None

if attention_triton is not None:
    @attention_own_key_.register_kernel("cuda")
    def _(out, ring, q, kv, weight, eps, rot, quantize, slots, widx, compressed, cidx, sink, positions, inv_freq,
          scale, window_fmt, compressed_fmt, early=False):
        _check(out, ring, q, kv, weight, rot, quantize, slots, window_fmt)
        batch = q.shape[0]
        if not attention_triton.own_key_fits(q, kv, widx, window_fmt):
            key = torch.ops.dsflash.kv_norm_rope_write_(ring, slots, window_fmt, kv, weight, eps, rot, quantize)
            torch.ops.dsflash.attention_(out, q, ring[:batch], key, widx, compressed, cidx, sink, positions,
                                         inv_freq, scale, window_fmt, compressed_fmt)
            return
        own = attention_triton.OwnKey(weight, eps, rot, quantize, slots, early)
        attention_triton.attention_triton(out, q, ring[:batch], kv, widx, compressed, cidx, sink, positions, inv_freq,
                                          scale, window_fmt, compressed_fmt, own_key=own)
