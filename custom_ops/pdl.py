"""Programmatic dependent launch (PDL, Hopper and later) for our Triton kernels.

A kernel launched with `launch_pdl=True` may be scheduled while the kernel before it on the stream still runs;
it must not read what earlier kernels write, nor write anything, before `griddepcontrol.wait`, which returns
once the previous kernel has finished and its memory is visible. Every kernel here calls `wait(PDL)` first and
`release(PDL)` (`launch_dependents`, which lets the next PDL kernel be scheduled) after it: short kernels at
once (`start`), weight-streaming ones after their main loop. Because each kernel releases its successor only
after its own wait, a kernel never starts its reads before all kernels two or more back have finished
(Inductor's PDL code, `torch._inductor.config.triton.enable_pdl`, keeps the same order).

What it buys: inside a CUDA graph the next kernel's launch and its programs' start overlap the end of the
previous one (H200, scripts/sweep_pdl.py: ~1 us a boundary after a latency-bound kernel). A process-wide
switch (`set_enabled`; `dsflash_compile.compile(pdl=...)`), read at launch: graphs keep the launches they
were captured with. Off on the CPU (the interpreter has no griddepcontrol) and before sm_90.
"""

from functools import lru_cache

import torch

try:  # Triton is optional on CPU machines; the switch is not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None

_enabled = [True, True]  # any kernel; the weight-streaming ones too


def set_enabled(on: bool, streaming: bool = True) -> None:
    """PDL launches from now on (`streaming`: the weight-streaming kernels' too)."""
    _enabled[:] = [on, on and streaming]


def is_enabled() -> bool:
    return _enabled[0]


@lru_cache
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch(device: torch.device, streaming: bool = False) -> dict:
    """Keywords for a kernel launch on `device`: the kernel's PDL constexpr and Triton's launch_pdl option.
    streaming: a weight-streaming kernel (GEMV, experts)."""
    on = _enabled[int(streaming)] and _supported(device)
    return {"PDL": on, "launch_pdl": on}


if triton is not None:
    @triton.jit
    def wait(PDL: tl.constexpr):
        """Before a kernel's first access to memory an earlier kernel may write: wait for the previous kernel."""
        if PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def release(PDL: tl.constexpr):
        """Let the next kernel be scheduled (after `wait`). Weight-streaming kernels call it after their main
        loop: released at their start, the next kernel's programs sat on the SMs through the whole loop, and
        back-to-back wo_b GEMVs took 29.2 us each against 24.7 plainly (sweep_pdl.py, H200)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def start(PDL: tl.constexpr):
        """First thing in a short kernel: wait for the previous kernel, then let the next one be scheduled."""
        wait(PDL)
        release(PDL)
