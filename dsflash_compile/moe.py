"""Mixture of experts (MODEL.md section 5): sqrt-softplus router with a selection-only bias, top-k
routed SwiGLU experts scaled by their normalised weights, plus one shared expert.

The router (`route`) stays a plain function so the compiler's gating pass can match and fuse it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_deepseek_v41 import DeepseekV41TextConfig
from .layers import QuantLinear


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, topk: int, normalize: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (weights fp32 [N, k], expert ids [N, k]). The bias picks experts but never scales them."""
    scores = F.softplus(F.linear(x.float(), weight.float())).sqrt()
    ids = (scores + bias).topk(topk, dim=-1)[1]
    weights = scores.gather(1, ids)
    if normalize and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class Gate(nn.Module):
    def __init__(self, config: DeepseekV41TextConfig):
        super().__init__()
        self.topk, self.normalize, self.scale = (config.num_experts_per_tok, config.norm_topk_prob,
                                                 config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))
        # Image-span routing bias of the release; text tokens never use it (kept so checkpoints round-trip).
        self.bias_vl = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.weight, self.bias, self.topk, self.normalize, self.scale)


class Expert(nn.Module):
    """SwiGLU in fp32 with the release's clamps: gate only from above, up on both sides."""

    def __init__(self, config: DeepseekV41TextConfig, storage: str):
        super().__init__()
        dim, inter, q = config.hidden_size, config.moe_intermediate_size, config.quantize_dequantize
        self.limit = config.swiglu_limit
        self.w1 = QuantLinear(dim, inter, q, storage)
        self.w2 = QuantLinear(inter, dim, q, storage)
        self.w3 = QuantLinear(dim, inter, q, storage)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, config: DeepseekV41TextConfig):
        super().__init__()
        if config.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts={config.n_shared_experts}: V4.1 has exactly one shared expert")
        self.gate = Gate(config)
        self.experts = nn.ModuleList(Expert(config, "mxfp4") for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(config, "fp8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(x)
        y = torch.zeros_like(x, dtype=torch.float32)
        # Token-by-expert loop in ascending expert id (the reference's summation order).
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            y[token] += self.experts[e](x[token], weights[token, slot, None])
        y += self.shared_experts(x)
        return y.to(x.dtype).view(shape)
