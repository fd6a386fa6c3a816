"""`dsflash` torch.library ops. Importing this package registers them (torch.ops.dsflash.*).

Each op has a plain-PyTorch reference (CPU and CUDA) and a fake kernel; Triton kernels register
themselves for CUDA on top of the reference in later modules.
"""

from . import cache_write, indexer, sparse_attention, topk  # noqa: F401  (registration side effects)
