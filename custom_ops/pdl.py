"""Programmatic dependent launch (PDL, Hopper and later) for our Triton kernels.

A kernel launched with `launch_pdl=True` may be scheduled while the kernel before it on the stream still runs;
it must not read what earlier kernels write, nor write anything, before `griddepcontrol.wait`, which returns
once the previous kernel has finished and its memory is visible. Every kernel here calls `wait(PDL)` first and
`release(PDL)` (`launch_dependents`, which lets the next PDL kernel be scheduled) after it: short kernels at
once (`start`), weight-streaming ones after their main loop. Because each kernel releases its successor only
after its own wait, a kernel never starts its reads before all kernels two or more back have finished
(Inductor's PDL code, `torch._inductor.config.triton.enable_pdl`, keeps the same order).

What it was to buy: inside a CUDA graph the next kernel's launch and its programs' start overlap the end of
the previous one. In isolation it does (H200, scripts/sweep_pdl.py: a GEMV after a 5-10 us one-program kernel
1.0-1.2 us sooner; GEMVs back to back 0.4-0.8 us, wo_b's 1.8 us later), but not in the model: flash-40l-e8
decode at batch 1, same machine, rounds in turns (12-02 p), 11.56 ms without PDL, 11.58 with the short kernels'
launches only, 11.70 with every kernel's (11.72 when the GEMVs released their successor at their start), the
logits bit-identical. So it is off by default (CompileOptions.pdl): untried at larger batches. A process-wide
switch (`set_enabled`; `dsflash_compile.compile(pdl=...)`), read at launch: graphs keep the launches they
were captured with. Never on the CPU (the interpreter has no griddepcontrol) or before sm_90.
"""

from functools import lru_cache

import torch

try:  # Triton is optional on CPU machines; the switch is not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None

_enabled = [False, False]  # any kernel; the weight-streaming ones too (off: see the module's docstring)


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
