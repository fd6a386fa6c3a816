"""`dsflash::fused_router`: the MoE router (MODEL.md section 5) as one op, for the gating-fusion pass.

    scores = sqrt(softplus(x @ Wg^T)) (fp32); ids = top-k(scores + bias); weights = scores[ids],
    normalised (+1e-20) and scaled

The reference is the model's own `moe.route` (one definition of the math); the fake kernel gives the
shapes. The gating pass (passes/router_fusion.py) rewrites the unfused graph of `route` into this op.
On CUDA the op is one Triton launch (router_triton.py); inputs that kernel does not take run the
reference: a gate that is not bf16, a bias that is not fp32, activations neither bf16 nor fp32, more
than 512 experts, or a top-k outside 1..E (the reference raises its own error for those).
"""

import torch
from torch import Tensor


@torch.library.custom_op("dsflash::fused_router", mutates_args=())
def fused_router(x: Tensor, weight: Tensor, bias: Tensor, topk: int, normalize: bool,
                 scale: float) -> tuple[Tensor, Tensor]:
    """x [N, D]; weight [E, D]; bias [E] fp32. Returns (weights fp32 [N, topk], expert ids int64 [N, topk])."""
    return fused_router_reference(x, weight, bias, topk, normalize, scale)


def fused_router_reference(x, weight, bias, topk, normalize, scale):
    """The op's math on any device: the model's `route`, outputs made contiguous."""
    from dsflash_compile.moe import route  # the model's definition (imported late: the model imports the ops)

    weights, ids = route(x, weight, bias, topk, normalize, scale)
    return weights.contiguous(), ids.contiguous()


@fused_router.register_fake
def _(x, weight, bias, topk, normalize, scale):
    return (x.new_empty(x.shape[0], topk, dtype=torch.float32), x.new_empty(x.shape[0], topk, dtype=torch.int64))


try:  # Triton is optional on CPU machines
    from . import router_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    router_triton = None

if router_triton is not None:
    @fused_router.register_kernel("cuda")
    def _(x, weight, bias, topk, normalize, scale):
        if not router_triton.kernel_fits(x, weight, bias, topk):
            return fused_router_reference(x, weight, bias, topk, normalize, scale)
        return router_triton.fused_router_triton(x, weight, bias, topk, normalize, scale)
