"""Programmatic dependent launch (PDL, sm_90+) for our Triton kernels inside CUDA graphs.

A decode step is ~1000 kernels back to back, each a few to ~80 us; at each boundary the GPU drains one grid
before the next starts and ramps up its loads. A kernel launched with PDL may start as soon as every program
of the kernel before it has signalled (`griddepcontrol.launch_dependents`): its programs wait
(`griddepcontrol.wait`, which returns once that kernel has completed and its writes are visible) and, before
waiting, may stream read-only weights into L2 (`prefetch_l2`), so a GEMV after a latency-bound kernel (an mHC
seam, the router) finds its first weight bytes in L2.

The protocol every PDL kernel here keeps (`wait_for_previous` first, in every program):
  - before the wait, a program reads only the op's weights (constant while a graph replays) and writes nothing;
  - it signals its dependents (`release_dependents`) only after its own wait, so the next kernel launches only
    once this one's predecessor has completed: a kernel's wait then covers everything launched before it, not
    just the kernel right before it;
  - it signals them after its main loop, not right after the wait: on the H200 (12-02 m) signalling at once
    made the B1 decode step 12.02 ms against 11.48 without PDL. The next kernel's programs then sat on the SMs
    through this one's main work, and the large GEMVs ran 2-6 us slower beside them (up 86.5 us after the
    router against 80.0, down 46.0 against 40.0, wo_b 25.9 against 23.1).
Kernels launched without PDL (Inductor's, cuBLAS's) wait for the whole stream as usual, so mixing is safe.

On only inside `dependent_launches()` (compiled.py captures its CUDA graphs inside it with
CompileOptions.pdl), on CUDA devices of compute capability 9.0 and up, never in Triton's interpreter.
"""

import os
from contextlib import contextmanager

import torch

try:  # Triton is optional on CPU machines: then only the switch below exists
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None

_active = False


@contextmanager
def dependent_launches(on: bool = True):
    """Our kernels launched within the block use PDL where the device has it (see `enabled`)."""
    global _active
    before, _active = _active, on
    try:
        yield
    finally:
        _active = before


def enabled(device: torch.device) -> bool:
    return (_active and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr and, when on, Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


if triton is not None:
    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """Wait until the kernel before this one has completed (its writes visible)."""
        if PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def release_dependents(PDL: tl.constexpr):
        """Let the next kernel launch once every program got here (or exited): after the main loop, so that its
        programs arrive as this one's finish, not beside its main work (see above)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs, nbytes, PDL: tl.constexpr):
        """Bulk-prefetch `nbytes` (a multiple of 16, from 16-byte aligned `ptrs`; one range per element, 0: none)
        into L2 (sm_90 `cp.async.bulk.prefetch.L2`: no registers, no completion to wait for). Only with PDL: it is
        for the time a program waits on the kernel before it."""
        if PDL:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
