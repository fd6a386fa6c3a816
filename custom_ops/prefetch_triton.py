"""Pull bytes from HBM into L2 ahead of the kernel that reads them (Hopper), and programmatic dependent launch.

A decode step at batch 1 alternates weight-streaming GEMVs with latency-bound kernels (mHC seams, attention,
router) during which HBM sits idle. `prefetch_l2` launches a few programs that each issue
`cp.async.bulk.prefetch.L2` over a share of a buffer: fire and forget, the copy engine fills L2 while the
next small kernels run, and the GEMV then reads the prefetched part from L2.

`gdc_wait` / `gdc_launch_dependents` wrap Triton's griddepcontrol intrinsics for kernels launched with
`launch_pdl=True` (PDL): such a kernel may start before the previous one ends, so it must wait before its
first read of anything an earlier kernel writes (and before any write); what it does before the wait may only
read constant buffers (weights).
"""

import triton
import triton.language as tl

PREFETCH_CHUNK = 16384  # bytes a lane asks for at once (a multiple of 16, as the instruction needs)


@triton.jit
def prefetch_bytes_l2(ptrs, nbytes):
    """Each lane: ask L2 for `nbytes` (a multiple of 16, > 0 or skipped) from `ptrs` (16-byte aligned)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2_kernel(ptr, nbytes, LANES: tl.constexpr, CHUNK: tl.constexpr):
    lane = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
    start = lane * CHUNK
    size = tl.minimum(tl.maximum(nbytes - start, 0), CHUNK).to(tl.int32)
    prefetch_bytes_l2(ptr + start, size)


def prefetch_l2(tensor, nbytes: int | None = None, lanes: int = 64) -> None:
    """Ask L2 for the first `nbytes` of a contiguous CUDA tensor (all of it by default)."""
    flat = tensor.view(-1).view(dtype=__import__("torch").uint8)
    total = flat.numel() if nbytes is None else min(nbytes, flat.numel())
    total -= total % 16
    if total <= 0:
        return
    grid = (triton.cdiv(total, lanes * PREFETCH_CHUNK),)
    _prefetch_l2_kernel[grid](flat, total, LANES=lanes, CHUNK=PREFETCH_CHUNK, num_warps=1)
