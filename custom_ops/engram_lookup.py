"""`dsflash::engram_lookup`: rows of the Engram table (FP8 E4M3, one UE8M0 scale per 32 values) gathered and
dequantized to bf16 in one launch: formats.lookup_fp8_rows, engram.EngramTable's math.

Why an op: compiled, the table's float8_e8m0fnu scales have no Inductor code (neither their `.float()` nor a view
as bytes), so their gather and widening ran as eager aten kernels before Inductor's dequantization: on the H200's
B1 step (12-04 d5 trace) an index (3.5 us, after an 8 us gap) and a copy (1.9 us) at each Engram layer. The kernel
(engram_lookup_triton.py) reads the codes and scales as bytes and decodes them from their bits. The CPU path is
the reference.
"""

import torch
from torch import Tensor

from dsflash_compile.formats import lookup_fp8_rows


def check_inputs(weight: Tensor, scale: Tensor, ids: Tensor) -> None:
    """Errors that name the problem."""
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"engram_lookup: weight must be float8_e4m3fn and scale float8_e8m0fnu, got {weight.dtype} "
                        f"and {scale.dtype}")
    if weight.dim() != 2 or tuple(scale.shape) != (weight.shape[0], -(-weight.shape[1] // 32)) or weight.shape[1] % 32:
        raise ValueError(f"engram_lookup: weight [rows, d] (d a multiple of 32) and scale [rows, d / 32], got "
                         f"{tuple(weight.shape)} and {tuple(scale.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"engram_lookup: ids must be int64 or int32, got {ids.dtype}")


def engram_lookup_reference(weight: Tensor, scale: Tensor, ids: Tensor) -> Tensor:
    check_inputs(weight, scale, ids)
    return lookup_fp8_rows(weight, scale, ids)


@torch.library.custom_op("dsflash::engram_lookup", mutates_args=())
def engram_lookup(weight: Tensor, scale: Tensor, ids: Tensor) -> Tensor:
    """weight float8_e4m3fn [rows, d]; scale float8_e8m0fnu [rows, d / 32]; ids [...] of rows. Returns bf16
    [..., d]: each row's codes times its group's scale."""
    return engram_lookup_reference(weight, scale, ids)


@engram_lookup.register_fake
def _(weight, scale, ids):
    check_inputs(weight, scale, ids)
    return weight.new_empty(*ids.shape, weight.shape[1], dtype=torch.bfloat16)


try:  # Triton is optional on CPU machines
    from . import engram_lookup_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    engram_lookup_triton = None

if engram_lookup_triton is not None:
    @engram_lookup.register_kernel("cuda")
    def _(weight, scale, ids):
        check_inputs(weight, scale, ids)
        if weight.shape[1] & (weight.shape[1] - 1):  # (the kernel's rows: a power of two of values)
            return engram_lookup_reference(weight, scale, ids)
        return engram_lookup_triton.engram_lookup_triton(weight, scale, ids)
