"""Triton kernel of `dsflash::l2_prefetch` (l2_prefetch.py): each lane of a one-warp program issues one
`cp.async.bulk.prefetch.L2` (sm_90, PTX 8.0) of CHUNK bytes, so a 24 MB prefetch is ~190 programs spread over the
SMs' copy engines, and the data moves without registers or shared memory.

With EARLY the kernel releases the next one at its top and waits only at its end (pdl.py): it is scheduled
beside the kernel before it (the pass's anchor) and prefetches while that one runs; the kernel after it still
waits for its end, which follows the anchor's. It loads nothing, so working before the wait is always safe.
"""

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_release, pdl_wait, pdl_wait_only

CHUNK = 4096  # bytes per bulk prefetch (a multiple of 16, as the instruction needs)
LANES = 32  # prefetches per program: one warp


@triton.jit
def _l2_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, EARLY: tl.constexpr,
                        PDL: tl.constexpr):
    if EARLY:
        pdl_release(PDL)
    else:
        pdl_wait(PDL)
    start = (tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)  # <= 0 past the end: no prefetch
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [base_ptr + start, size], dtype=tl.int32, is_pure=False, pack=1)
    if EARLY:
        pdl_wait_only(PDL)


def l2_prefetch(weight: torch.Tensor, nbytes: int, early: bool = True) -> None:
    """Prefetch the first nbytes of a contiguous weight starting on a 16-byte boundary (sm_90+; nbytes rounded down
    to 16) into L2."""
    nbytes -= nbytes % 16
    if nbytes == 0:
        return
    flat = weight.reshape(-1).view(torch.uint8)
    grid = (triton.cdiv(nbytes, CHUNK * LANES),)
    _l2_prefetch_kernel[grid](flat, nbytes, CHUNK=CHUNK, LANES=LANES, EARLY=early, num_warps=1,
                              **launch_options(weight.device))
