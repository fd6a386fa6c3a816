"""`dsflash::l2_prefetch_`: start moving a weight's bytes into L2 while latency-bound kernels run.

    for each of `pieces` equal pieces of `weight`'s bytes: its first nbytes / pieces bytes go to L2

A decode step alternates between weight-streaming GEMVs, which keep HBM busy, and short latency-bound kernels
(an mHC seam, attention, the router: ~50 us a layer at batch 1 on the H200) during which HBM is nearly idle.
Issued before such a stretch, this op lets the next GEMV find part of its weight in L2. It computes nothing: the
reference does nothing, and on CUDA (sm_90) one short launch hands the ranges to the copy engines
(l2_prefetch_triton.py) and returns while the bytes arrive.

`after` is declared mutated though nothing writes it: the op then has side effects (the compiler keeps it)
and runs after the kernel that produced `after` and before that tensor's readers (passes/weight_prefetch.py
passes the output of the GEMV before the stretch, so the prefetch does not compete with that GEMV).
"""

import os

import torch
from torch import Tensor

ALIGN = 16  # the bulk prefetch's address and size granularity


@torch.library.custom_op("dsflash::l2_prefetch_", mutates_args=("after",))
def l2_prefetch_(after: Tensor, weight: Tensor, nbytes: int, pieces: int) -> None:
    """after: any tensor (ordering only); weight: contiguous, 16-byte aligned; nbytes: bytes to prefetch in all,
    split evenly over `pieces` equal pieces of the weight (each piece's first nbytes / pieces bytes)."""
    check_inputs(weight, nbytes, pieces)


def check_inputs(weight: Tensor, nbytes: int, pieces: int) -> None:
    """Errors that name the problem."""
    total = weight.numel() * weight.element_size()
    if not weight.is_contiguous():
        raise ValueError(f"l2_prefetch_: weight must be contiguous, got strides {weight.stride()}")
    if pieces < 1 or total % (pieces * ALIGN):
        raise ValueError(f"l2_prefetch_: pieces={pieces} must be >= 1 and split the weight's {total} bytes into "
                         f"multiples of {ALIGN}")
    if not 0 <= nbytes <= total:
        raise ValueError(f"l2_prefetch_: nbytes={nbytes} must lie in [0, {total}] (the weight's bytes)")


def piece_plan(weight: Tensor, nbytes: int, pieces: int) -> tuple[int, int]:
    """(bytes per piece, bytes taken from each piece's start: nbytes / pieces rounded down to ALIGN)."""
    piece = weight.numel() * weight.element_size() // pieces
    return piece, nbytes // pieces // ALIGN * ALIGN


@l2_prefetch_.register_fake
def _(after, weight, nbytes, pieces):
    check_inputs(weight, nbytes, pieces)


try:  # Triton is optional on CPU machines
    from . import l2_prefetch_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    l2_prefetch_triton = None


def kernel_fits(weight: Tensor) -> bool:
    """The bulk prefetch exists from sm_90 on; the interpreter cannot run inline PTX (nothing to emulate)."""
    return (l2_prefetch_triton is not None and weight.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability(weight.device)[0] >= 9 and weight.data_ptr() % ALIGN == 0)


if l2_prefetch_triton is not None:
    @l2_prefetch_.register_kernel("cuda")
    def _(after, weight, nbytes, pieces):
        check_inputs(weight, nbytes, pieces)
        piece, take = piece_plan(weight, nbytes, pieces)
        if take and kernel_fits(weight):
            l2_prefetch_triton.l2_prefetch_triton(weight.view(-1).view(torch.uint8), piece, take, pieces)
