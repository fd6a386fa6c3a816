"""Run every `dsflash` op on its PyTorch reference, even where a Triton kernel is registered (CUDA).

The day-zero baseline of the benchmarks (BENCHMARKS.md) is the eager model on reference ops; this
switches the registered device kernels off for the duration of a `with` block.
"""

from contextlib import ExitStack, contextmanager

from torch._library.custom_ops import OPDEFS


@contextmanager
def reference_kernels(device_type: str = "cuda"):
    """Within the block, dsflash ops with a `device_type` kernel run their reference implementation."""
    with ExitStack() as stack:
        for name, op in OPDEFS.items():
            if name.startswith("dsflash::") and device_type in op._backend_fns:
                stack.enter_context(op.set_kernel_enabled(device_type, False))
        yield
