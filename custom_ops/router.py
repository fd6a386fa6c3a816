"""`dsflash::fused_router`: the MoE router (MODEL.md section 5) as one op, for the gating-fusion pass.

    scores = sqrt(softplus(x @ Wg^T)) (fp32); ids = top-k(scores + bias); weights = scores[ids],
    normalised (+1e-20) and scaled

The reference is the model's own `moe.route` (one definition of the math); the fake kernel gives the
shapes. The gating pass (passes/router_fusion.py) rewrites the unfused graph of `route` into this op.
"""

import torch
from torch import Tensor


@torch.library.custom_op("dsflash::fused_router", mutates_args=())
def fused_router(x: Tensor, weight: Tensor, bias: Tensor, topk: int, normalize: bool,
                 scale: float) -> tuple[Tensor, Tensor]:
    """x [N, D]; weight [E, D]; bias [E] fp32. Returns (weights fp32 [N, topk], expert ids int64 [N, topk])."""
    from dsflash_compile.moe import route  # the model's definition (imported late: the model imports the ops)

    weights, ids = route(x, weight, bias, topk, normalize, scale)
    return weights.contiguous(), ids.contiguous()


@fused_router.register_fake
def _(x, weight, bias, topk, normalize, scale):
    return (x.new_empty(x.shape[0], topk, dtype=torch.float32), x.new_empty(x.shape[0], topk, dtype=torch.int64))
