"""`dsflash` torch.library ops. Importing this package registers them (torch.ops.dsflash.*).

Each op has a plain-PyTorch reference (CPU and CUDA) and a fake kernel; where a Triton kernel exists it is
registered for CUDA (`register_kernel("cuda")`) and the reference stays the CPU path.
"""

from . import attention, indexer, records, router, topk  # noqa: F401  (registration side effects)
from . import mhc, mhc_split  # noqa: F401  (registration side effects: the mHC seam ops, fused and split)
from . import mhc_deferred  # noqa: F401  (registration side effects: the seam ops with their mixes finished later)
from . import fp8_linear, mxfp4_experts  # noqa: F401  (registration side effects: native-weight projections)
from . import routed_experts  # noqa: F401  (registration side effects: the few-token routed experts)
from . import bf16_gemv, bf16_linear  # noqa: F401  (registration side effects: the few-row bf16 projections)
from . import fp32_gemv  # noqa: F401  (registration side effects: one row of an fp32 projection)
from . import kv_norm_rope  # noqa: F401  (registration side effects: the attention's key/value row)
from . import attention_own_key  # noqa: F401  (registration side effects: decode's attention making its key)
from . import compress_token  # noqa: F401  (registration side effects: decode's compressor after its projection)
from . import expert_order  # noqa: F401  (registration side effects: the sorted MoE path's orders)
from . import grouped_swiglu  # noqa: F401  (registration side effects: the sorted MoE path's gate/up/SwiGLU)
from . import rope_tail  # noqa: F401  (registration side effects: RoPE of the query heads in place)
from . import fp8_qdq  # noqa: F401  (registration side effects: the activations' FP8 before cuBLAS projections)
from . import rope_fp4_qdq  # noqa: F401  (registration side effects: the indexer query's RoPE and FP4 in place)
from . import token_sum  # noqa: F401  (registration side effects: MoE's sorted rows summed back per token)
from . import engram_lookup  # noqa: F401  (registration side effects: Engram table rows gathered and dequantized)
