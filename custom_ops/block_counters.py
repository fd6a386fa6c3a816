"""Per-block int32 counters for kernels whose last-arriving program finishes a block (mhc_triton.py,
router_triton.py, the GEMVs, routed_experts_triton.py): a persistent zeroed buffer per device and lane that each
launch leaves at zero, so a call needs no memset and the kernels stay CUDA-graph safe."""

import torch

COUNTER_SLOTS = 4096
_counters: dict = {}
_outgrown: list = []  # smaller buffers replaced by larger ones, never freed


def block_counters(device: torch.device, blocks: int, lane: str = "main") -> torch.Tensor:
    """Zeroed int32 counters, kept per device and lane (each launch leaves them at zero) so a call needs no
    memset. Kernels of one lane never run at the same time; the mixes launch of an overlapped seam runs on
    the side stream beside the router and seam kernels, so it counts on lane "side"."""
    key = (device, lane)
    buf = _counters.get(key)
    if buf is not None and buf.numel() >= blocks:
        return buf
    buf = torch.zeros(max(blocks, COUNTER_SLOTS), dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():  # never keep a graph-pool buffer
        if key in _counters:  # graphs captured earlier still point at the old buffer: keep it alive
            _outgrown.append(_counters[key])
        _counters[key] = buf
    return buf
