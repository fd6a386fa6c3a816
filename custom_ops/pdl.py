"""Programmatic dependent launch (PDL, sm_90+) for the dsflash kernels.

A kernel launched with PDL may be scheduled while the kernel before it on the stream still runs: its programs
start, wait in `pdl_wait` until that kernel has finished (its writes visible), then let the next kernel be
scheduled in turn. The gap between two kernels (the launch of the second once the first has drained: ~0.4 us
each, ~880 kernels a B1 decode step on the H200) then overlaps the first's run. CUDA graphs captured from such
launches keep the dependency as a programmatic edge.

The rule every dsflash kernel follows: `pdl_wait(PDL)` before its first load or store of anything an earlier
kernel may write or read (so, at its top). A kernel that passed its wait can only run after the one before it
finished, which finished after the one before that, so the order holds along the whole stream, with kernels
launched without PDL (Inductor's, cuBLAS's) in between as well.

One kind of kernel works before its wait (mhc_mixes_finish_triton.py): `pdl_release` at its top lets the next
kernel be scheduled at once, it reads only what a kernel at least two launches back wrote (finished: the kernel
just before it has passed its own wait), and `pdl_wait_only` comes before its first store. Early ops
(passes/early_reads.py: kv_norm_rope, the one-row GEMVs) read before their wait what was written before a kernel
that waits before it lets the next be scheduled (their `after`'s: every launch after that kernel's needs it past
its wait); a GEMV's `pdl_wait` then comes before its first store, so the kernels after it keep the rule.
Inductor's own PDL kernels (its triton.enable_pdl) read before their wait whatever a node other than the one just
before them wrote, which holds behind a kernel that waits before letting the next be scheduled; behind a
`pdl_release` kernel it would not: such a kernel must be followed by one that waits before reading (the deferred
mixes' finish is placed right before the seam that reads them, passes/mhc_defer.py; in the B1 traces the seam
kernel follows it).

`launch_options(device)` gives a kernel launch its keyword arguments: PDL on sm_90+ CUDA devices unless turned off
(`DSFLASH_PDL=0`, or `launches(False)` around the calls, as CompileOptions.pdl does around a runner's graphs).
Off (and for CPU tensors: Triton's interpreter, which runs no inline PTX) `PDL` is False and the wait compiles away.
"""

import functools
import os
from contextlib import contextmanager

import torch

try:  # Triton is optional on CPU machines (the runner still sets the switch)
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None

_on = os.environ.get("DSFLASH_PDL", "1") != "0"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels launched now on `device` use PDL."""
    return _on and device.type == "cuda" and _capable(
        device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device, early: bool = True) -> dict:
    """Keyword arguments of a dsflash kernel launch on `device`: the kernel's PDL constexpr and Triton's
    launch_pdl (the launch attribute) when on. early=False: the kernel itself starts only once the kernel
    before it has finished (its own wait is then a no-op; the kernel after it may still start early). For
    grids sized to fill every SM in one wave: started early, their programs are placed beside the previous
    kernel's, and the ones that no longer fit run as a second wave (H200, B1: the routed experts' up kernel,
    504 programs after the router's 8, took 6 us more a layer)."""
    if not enabled(device):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True} if early else {"PDL": True}


@contextmanager
def launches(on: bool):
    """Within the block, dsflash kernels launch with PDL if `on` (and the device has it); restored after."""
    global _on
    before, _on = _on, on
    try:
        yield
    finally:
        _on = before


if triton is not None:
    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait until the stream's previous kernel has finished, then let the next one be scheduled (PDL only)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def pdl_release(PDL: tl.constexpr):
        """Let the next kernel be scheduled now, before this kernel's wait (its own wait still waits for this
        kernel's end): for a kernel that works before its wait, which then calls pdl_wait_only."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait_only(PDL: tl.constexpr):
        """Wait until the stream's previous kernel has finished (after pdl_release)."""
        if PDL:
            gdc_wait()
