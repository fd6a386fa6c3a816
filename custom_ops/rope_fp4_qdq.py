"""`dsflash::rope_fp4_qdq_`: the indexer's query row, RoPE then FP4 quantize-dequantize, in place.

    x = quant.fp4_qdq_ue8m0(rope.apply_rope(x, rot))      (E2M1 with power-of-two scales, groups of 32)

Why an op: compiled, the two are one Inductor persistent reduction whose launch Inductor's runtime autotuner picks
anew in every compile, and some picks serialize the work: on the H200 (flash-40l-e8 decode traces, 12-02 s) the
indexer's query (32 heads x 128) took 24 us at B1 in one compile (grid 1) and 6.2 in another (grid 16), 20.7 us at
B64 (grid 64), in each of the step's 9 index layers. The kernel (rope_fp4_qdq_triton.py) runs a fixed launch.
Mutating wq_b's fresh output in place, the compiled graph needs no new buffer. Values: the RoPE as dsflash::rope_
(on the GPU its FMAs round once where eager torch rounds twice, within one bf16 ulp; Inductor fuses the same
FMAs), then the QDQ exactly (maxima, power-of-two scales and E2M1 rounding have no summation order).
"""

import torch
from torch import Tensor

from dsflash_compile.quant import fp4_qdq_ue8m0
from dsflash_compile.rope import apply_rope

from .rope_tail import check_inputs as check_rope_inputs

GROUP = 32


@torch.library.custom_op("dsflash::rope_fp4_qdq_", mutates_args=("x",))
def rope_fp4_qdq_(x: Tensor, rot: Tensor) -> None:
    """x bf16 [..., T, heads, D] or [..., T, D], D a multiple of 32; rot fp32 [..., T, p, 2] (rope.rotation):
    x's last 2p dims rotated, then every group of 32 values FP4 quantize-dequantized, in place."""
    rope_fp4_qdq_reference_(x, rot)


def check_inputs(x: Tensor, rot: Tensor) -> None:
    """Errors that name the problem."""
    check_rope_inputs(x, rot)
    if x.shape[-1] % GROUP:
        raise ValueError(f"rope_fp4_qdq_: x has shape {tuple(x.shape)}; its last dim must be a multiple of the "
                         f"FP4 group ({GROUP})")


def rope_fp4_qdq_reference_(x, rot):
    check_inputs(x, rot)
    x.copy_(fp4_qdq_ue8m0(apply_rope(x, rot)))


@rope_fp4_qdq_.register_fake
def _(x, rot):
    check_inputs(x, rot)


try:  # Triton is optional on CPU machines
    from . import rope_fp4_qdq_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    rope_fp4_qdq_triton = None

if rope_fp4_qdq_triton is not None:
    @rope_fp4_qdq_.register_kernel("cuda")
    def _(x, rot):
        check_inputs(x, rot)
        if not x.is_contiguous():
            return rope_fp4_qdq_reference_(x, rot)
        rope_fp4_qdq_triton.rope_fp4_qdq_triton_(x, rot)
