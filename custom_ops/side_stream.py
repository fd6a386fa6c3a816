"""One side CUDA stream per device, for work whose result is needed only some kernels later (issue 8: the
next mHC seam's mixes, overlapped with attention or the MoE).

`fork(device, fn, inputs)` runs `fn` on the side stream after everything queued so far on the current stream;
`join(device)` makes the current stream wait for everything forked since the last join. Inside a CUDA graph
capture this is the fork/join pattern graphs allow: the side stream joins the capture by waiting on an event
recorded in the capturing stream, and the join's event wait brings its work back into the capturing stream
(capture fails loudly if a fork is never joined). On the CPU, or inside `enabled(False)`, `fork` just calls
`fn` on the current stream: the same kernels, in program order.

Allocator: what `fn` allocates comes from the side stream's pool, so its results are `record_stream`ed on the
current stream (they are read and freed there) and the inputs on the side stream (the current stream may
free them while the side stream still reads them). During a capture the allocator then keeps those blocks
until the capture ends instead of reusing them inside the graph.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_side: dict[torch.device, torch.cuda.Stream] = {}
_pending: dict[torch.device, list[torch.cuda.Event]] = {}
_enabled = [True]


@contextmanager
def enabled(on: bool):
    """Within the block, `fork` runs on the side stream only if `on` (graphs captured inside keep that)."""
    before = _enabled[0]
    _enabled[0] = on
    try:
        yield
    finally:
        _enabled[0] = before


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream (default priority: the forked work should fill idle SMs, not delay the
    kernels of the critical path)."""
    if device not in _side:
        _side[device] = torch.cuda.Stream(device)
    return _side[device]


def fork(device: torch.device, fn, inputs: list[torch.Tensor]):
    """fn() on the side stream after the current stream's queued work; returns its tensors (a tuple)."""
    if device.type != "cuda" or not _enabled[0]:
        return fn()
    current = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        results = fn()
        done = torch.cuda.Event()
        done.record(side)
    for t in inputs:
        t.record_stream(side)
    for t in results:
        t.record_stream(current)
    _pending.setdefault(device, []).append(done)
    return results


def join(device: torch.device) -> None:
    """The current stream waits for the work forked on `device` since the last join (none: a no-op)."""
    if device.type != "cuda":
        return
    current = torch.cuda.current_stream(device)
    for done in _pending.pop(device, []):
        current.wait_event(done)
