"""`dsflash::l2_prefetch`: start pulling the first bytes of a weight into the GPU's L2 cache while kernels bound by
latency run, so that the projection that streams the weight next finds those bytes there (issue 5).

At decode batch 1 each layer streams its projections' weights at HBM speed, and between them run kernels bound by
latency (mHC seams, the router, RoPE, attention: ~30 us a layer on the H200) while HBM idles. The prefetch pass
(passes/l2_prefetch.py) puts this op right after the first such kernel after a projection; its kernel
(l2_prefetch_triton.py) issues `cp.async.bulk.prefetch.L2` for the weight's first `nbytes` and ends.

Schema: `after` is declared written, and nothing writes it. A kernel without outputs is dead code to Inductor,
and the declared write both keeps the op and pins it between `after`'s producer and that tensor's readers.
`early`: the kernel lets the next one be scheduled and prefetches before its PDL wait (it reads nothing any
kernel writes); off, it waits first.

The reference does nothing: a prefetch changes no value. CPU tensors, devices before sm_90 and weights whose
start is not 16-byte aligned take it.
"""

import torch
from torch import Tensor


def check_inputs(weight: Tensor, nbytes: int) -> None:
    if not weight.is_contiguous():
        raise ValueError(f"l2_prefetch: the weight must be contiguous (its first bytes are the ones prefetched), got "
                         f"strides {weight.stride()} for shape {tuple(weight.shape)}")
    size = weight.numel() * weight.element_size()
    if not 0 <= nbytes <= size:
        raise ValueError(f"l2_prefetch: nbytes={nbytes} is not within the weight's {size} bytes")


@torch.library.custom_op("dsflash::l2_prefetch", mutates_args=("after",))
def l2_prefetch(after: Tensor, weight: Tensor, nbytes: int, early: bool = True) -> None:
    """Prefetch weight's first nbytes into L2 (a hint: no value changes); `after` is only an anchor."""
    check_inputs(weight, nbytes)


@l2_prefetch.register_fake
def _(after, weight, nbytes, early=True):
    check_inputs(weight, nbytes)


try:  # Triton is optional on CPU machines
    from . import l2_prefetch_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    l2_prefetch_triton = None


def prefetches_on(device: torch.device) -> bool:
    """Whether the op's kernel runs on `device` (an sm_90+ CUDA device); elsewhere the op does nothing."""
    if l2_prefetch_triton is None or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device.index if device.index is not None else None)[0] >= 9


if l2_prefetch_triton is not None:
    @l2_prefetch.register_kernel("cuda")
    def _(after, weight, nbytes, early=True):
        check_inputs(weight, nbytes)
        if prefetches_on(weight.device) and weight.data_ptr() % 16 == 0:
            l2_prefetch_triton.l2_prefetch(weight, nbytes, early)
