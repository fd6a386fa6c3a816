"""`dsflash::routed_moe`: the MoE router and the few-token routed experts with the shared expert stacked, as one
op (the router-experts pass, passes/router_experts_fusion.py, rewrites `fused_router` then `routed_experts`
into it).

    weights, ids = fused_router(x, gate, bias, topk, normalize, scale)
    y = routed_experts(x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared_expert, out_bf16)

Returns (y, weights, ids). The reference is those two ops' references; on CUDA the three launches of
routed_moe_triton.py compute the shared expert's up projection beside the router (it needs no routing), with
the same values as the two ops' kernels. Inputs those launches do not take (no shared expert, another dtype, more
tokens than routed_experts' kernels) run the two ops one after the other.
"""

import torch
from torch import Tensor

from .routed_experts import check_inputs, routed_experts, routed_experts_reference
from .router import fused_router, fused_router_reference


@torch.library.custom_op("dsflash::routed_moe", mutates_args=())
def routed_moe(x: Tensor, gate: Tensor, bias: Tensor, topk: int, normalize: bool, scale: float, w1: Tensor,
               w3: Tensor, w2: Tensor, limit: float, quantize_x: bool, quantize_h: bool, shared_expert: int,
               out_bf16: bool) -> tuple[Tensor, Tensor, Tensor]:
    """x bf16 [T, D]; gate [E, D]; bias fp32 [E]; the stacks and flags as routed_experts'. Returns (y [T, D],
    weights fp32 [T, topk], ids int64 [T, topk])."""
    weights, ids = fused_router_reference(x, gate, bias, topk, normalize, scale)
    y = routed_experts_reference(x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared_expert, out_bf16)
    return y, weights, ids


def _check(x, topk, w1, w3, w2, quantize_x, quantize_h, shared_expert, device=None) -> tuple[Tensor, Tensor]:
    """routed_experts' checks on the routing the router gives; returns that routing's empty (weights, ids) on
    `device` (None: x's)."""
    routing = (x.new_empty(x.shape[0], topk, dtype=torch.float32, device=device),
               x.new_empty(x.shape[0], topk, dtype=torch.int64, device=device))
    check_inputs(x, *routing, w1, w3, w2, quantize_x, quantize_h, shared_expert)
    return routing


@routed_moe.register_fake
def _(x, gate, bias, topk, normalize, scale, w1, w3, w2, limit, quantize_x, quantize_h, shared_expert, out_bf16):
    routing = _check(x, topk, w1, w3, w2, quantize_x, quantize_h, shared_expert)
    return x.new_empty(x.shape, dtype=torch.bfloat16 if out_bf16 else torch.float32), *routing


try:  # Triton is optional on CPU machines
    from . import routed_moe_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    routed_moe_triton = None

if routed_moe_triton is not None:
    @routed_moe.register_kernel("cuda")
    def _(x, gate, bias, topk, normalize, scale, w1, w3, w2, limit, quantize_x, quantize_h, shared_expert,
          out_bf16):
        experts = (w1, w3, w2, limit, quantize_x, quantize_h, shared_expert)
        if not routed_moe_triton.kernel_fits(x, gate, bias, topk, w1, w3, w2, shared_expert):
            weights, ids = fused_router(x, gate, bias, topk, normalize, scale)
            return routed_experts(x, weights, ids, *experts, out_bf16), weights, ids
        _check(x, topk, w1, w3, w2, quantize_x, quantize_h, shared_expert, device="meta")
        return routed_moe_triton.routed_moe_triton(x, gate, bias, topk, normalize, scale, *experts, out_bf16)
