"""Ask L2 for a weight's bytes before a kernel's PDL wait (Hopper's `cp.async.bulk.prefetch.L2`).

A kernel launched with PDL may be resident before the kernel ahead of it ends (pdl.py); its weights, which no
kernel writes, may be read then. A one-row GEMV's programs land as the previous GEMV's programs leave, in its
tail, when HBM has bandwidth to spare: a prefetch there moves the first tiles of the program's weight into L2
while it waits, so its pipeline starts on L2 hits. Fire and forget: no registers or shared memory held.
"""

import triton
import triton.language as tl


@triton.jit
def prefetch_rows_l2(ptrs, nbytes):
    """Each lane asks L2 for `nbytes` (a multiple of 16, > 0) from `ptrs` (16-byte aligned)."""
    tl.inline_asm_elementwise("{ cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
