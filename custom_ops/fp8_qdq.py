"""`dsflash::fp8_qdq`: FP8 quantize-dequantize of activations in groups of 32, at a fixed launch.

    out = quant.fp8_qdq(x)     (E4M3 codes times each group's power-of-two scale, back in x's dtype)

Why an op: compiled, the QDQ before each cuBLAS projection (decode above dsflash::bf16_linear's rows) is an
Inductor persistent reduction whose launch (XBLOCK 1 / 8 / 32 / 128) Inductor's runtime autotuner picks anew in
every compile, and the picks swing: on the H200 (flash-40l-e8 B64, 74 such launches a step) the same graphs ran
at 1.8 us a launch in one compile and at 7.2-8.2 us (grid 10240 or 80) in others, ~0.5 ms a step
(decode-trace-*-2026-12-02-r/s). The kernel (fp8_qdq_triton.py) runs 32 groups a program, every compile alike.
Its values are the reference's (max, power-of-two scales and E4M3 rounding are exact: no summation order).
"""

import torch
from torch import Tensor

from dsflash_compile.quant import fp8_qdq as fp8_qdq_reference

GROUP = 32


@torch.library.custom_op("dsflash::fp8_qdq", mutates_args=())
def fp8_qdq(x: Tensor) -> Tensor:
    """x bf16 [..., K], K a multiple of 32. Returns bf16 [..., K] (contiguous): quant.fp8_qdq(x)."""
    check_inputs(x)
    return fp8_qdq_reference(x).contiguous()


def check_inputs(x: Tensor) -> None:
    """Errors that name the problem."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"fp8_qdq: x must be bf16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % GROUP:
        raise ValueError(f"fp8_qdq: x has shape {tuple(x.shape)}; its last dim must be a multiple of the FP8 "
                         f"group ({GROUP})")


@fp8_qdq.register_fake
def _(x):
    check_inputs(x)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


try:  # Triton is optional on CPU machines
    from . import fp8_qdq_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    fp8_qdq_triton = None

if fp8_qdq_triton is not None:
    @fp8_qdq.register_kernel("cuda")
    def _(x):
        check_inputs(x)
        return fp8_qdq_triton.fp8_qdq_triton(x)
