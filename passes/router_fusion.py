"""Gating fusion: the graph of `moe.route` (router GEMM, sqrt-softplus, bias, top-k, gather of the
unbiased scores, normalise, scale) becomes one `dsflash::fused_router` call.

The pattern is traced from `route` itself with the pattern matcher (so it sees the same decompositions
as the model's graph), once per activation dtype (bf16 inputs add an fp32 cast that fp32 inputs do not)
and with the model's own top-k, normalisation and scale as constants.
"""

import torch
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

from dsflash_compile.moe import route


class RouterFusionPass:
    name = "router_fusion"

    def __init__(self, topk: int, normalize: bool, scale: float, experts: int = 8, hidden: int = 64):
        self.options = {"topk": topk, "normalize": normalize, "scale": scale}
        self.patterns = PatternMatcherPass(pass_name=self.name)

        def search(x, weight, bias):
            return route(x, weight, bias, topk, normalize, scale)

        def replace(x, weight, bias):
            return torch.ops.dsflash.fused_router(x, weight, bias, topk, normalize, scale)

        for dtype in (torch.bfloat16, torch.float32):
            example = [torch.empty(4, hidden, dtype=dtype), torch.empty(experts, hidden, dtype=torch.bfloat16),
                       torch.empty(experts)]
            register_replacement(search, replace, example, fwd_only, self.patterns)

    def apply(self, graph: torch.fx.Graph) -> int:
        """Rewrite every match in `graph`; returns how many were replaced."""
        return self.patterns.apply(graph)
