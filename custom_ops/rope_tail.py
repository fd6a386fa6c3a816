"""`dsflash::rope_`: RoPE of a tensor's trailing pairs, in place (the attention's query heads).

    x[..., -2p:] = RoPE of those dims by rot              (fp32, rounded to bf16: rope.apply_rope's math)

Why an op: written functionally (rope.apply_rope's cat, or a slice_scatter), the compiled decode step rotates
the query heads in a kernel over all of q's columns, since Inductor lowers a scatter into a slice as a pointwise
kernel over the whole tensor: on the H200 (flash-40l-e8, B64, 12-02 q/r traces) 6.7-6.8 us a layer for the 64 x
64 x 512 query, 64 of whose 512 columns rotate. Mutating q (a projection's fresh output) in place, the compiled
graph updates that buffer and the kernel (rope_tail_triton.py) touches only the rotated eighth: its values equal
Inductor's compiled apply_rope bit for bit on the H200 (both fuse the products into FMAs; eager torch rounds them
apart, within one bf16 ulp). The reference is the model's own function (CPU, and CUDA inputs the kernel does not
take).
"""

import torch
from torch import Tensor

from dsflash_compile.rope import apply_rope


@torch.library.custom_op("dsflash::rope_", mutates_args=("x",))
def rope_(x: Tensor, rot: Tensor) -> None:
    """x bf16 [..., T, heads, D] or [..., T, D]; rot fp32 [..., T, p, 2] (rope.rotation): x's last 2p dims
    rotated in place, as rope.apply_rope."""
    rope_reference_(x, rot)


def check_inputs(x: Tensor, rot: Tensor) -> None:
    """Errors that name the problem."""
    if x.dtype != torch.bfloat16 or rot.dtype != torch.float32:
        raise TypeError(f"rope_: x must be bf16 and rot fp32, got {x.dtype} and {rot.dtype}")
    lead = x.shape[:-2] if x.dim() == rot.dim() else x.shape[:-1]  # with a heads dim or without
    if (rot.dim() < 3 or tuple(rot.shape[:-2]) != tuple(lead) or rot.shape[-1] != 2 or rot.shape[-2] < 1
            or 2 * rot.shape[-2] > x.shape[-1]):
        raise ValueError(f"rope_: rot has shape {tuple(rot.shape)}; expected {tuple(lead)} + (pairs, 2) with "
                         f"1 <= pairs and 2 * pairs <= {x.shape[-1]} for x {tuple(x.shape)}")
    if rot.device != x.device:
        raise ValueError(f"rope_: x is on {x.device} and rot on {rot.device}")


def rope_reference_(x, rot):
    check_inputs(x, rot)
    x.copy_(apply_rope(x, rot))


@rope_.register_fake
def _(x, rot):
    check_inputs(x, rot)


try:  # Triton is optional on CPU machines
    from . import rope_tail_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    rope_tail_triton = None

if rope_tail_triton is not None:
    @rope_.register_kernel("cuda")
    def _(x, rot):
        check_inputs(x, rot)
        if not rope_tail_triton.kernel_fits(x, rot):
            return rope_reference_(x, rot)
        rope_tail_triton.rope_tail_triton_(x, rot)
