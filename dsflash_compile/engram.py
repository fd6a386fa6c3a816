"""Engram (MODEL.md section 3): an n-gram hash lookup gated into every residual stream.

The hash ids come from `engram_hash` (token ids only). The table stays in its release format (FP8 E4M3
with one UE8M0 scale per 32 values of a row): it is the largest tensor of the model (384M rows in the
release), so rows are dequantized on lookup rather than held in bf16.
"""

import torch
from torch import nn

from .configuration_deepseek_v41 import DeepseekV41TextConfig
from .formats import lookup_fp8_rows
from .layers import quant_linear
from .mhc import PendingPost, expanded


class EngramTable(nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, dim, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(rows, dim // 32, dtype=torch.float8_e8m0fnu), requires_grad=False)
        self.lookup_op = False  # the rows as dsflash::engram_lookup (compile() sets it)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lookup_op:
            return torch.ops.dsflash.engram_lookup(self.weight, self.scale, ids)
        return lookup_fp8_rows(self.weight, self.scale, ids)


class Engram(nn.Module):
    def __init__(self, config: DeepseekV41TextConfig, rows: int):
        super().__init__()
        self.dim, self.hc, self.eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        cols = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.embed = EngramTable(rows, config.engram_head_dim)
        self.wkv = quant_linear(config, cols * config.engram_head_dim, self.dim * (self.hc + 1), config.quantize_dequantize)
        self.q_weight = nn.Parameter(torch.ones(self.hc, self.dim, dtype=torch.bfloat16))
        self.k_weight = nn.Parameter(torch.ones(self.hc, self.dim, dtype=torch.bfloat16))

    def forward(self, streams: torch.Tensor | PendingPost, hash_ids: torch.Tensor) -> torch.Tensor:
        """streams [B, S, hc, D] bf16 (or the block before's, its expansion pending: done here, in Engram's
        compiled graph); hash_ids [B, S, cols]. Per stream j: a normalised dot of X_j with its key gates the
        shared value into X_j (signed sqrt before the sigmoid)."""
        streams = expanded(streams)
        kv = self.wkv(self.embed(hash_ids).flatten(-2))
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))
        weight = self.q_weight.float() * self.k_weight.float()
        h = streams.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * self.dim ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
