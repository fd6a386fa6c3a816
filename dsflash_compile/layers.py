"""Small building blocks shared by the model: RMSNorm and the release's quantized-input linear."""

import torch
import torch.nn.functional as F
from torch import nn

from .quant import fp8_qdq


class RMSNorm(nn.Module):
    """w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back once (the reference's rounding)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class QuantLinear(nn.Module):
    """A projection stored in the release as FP8 (32x32 tiles) or MXFP4: the weight is held here
    dequantized (exactly) in bf16, and with `quantize_input` the activation is FP8 quantize-dequantized
    in groups of 32 first, as the release's GEMMs do. The product accumulates in fp32, output bf16."""

    def __init__(self, in_features: int, out_features: int, quantize_input: bool = True, storage: str = "fp8"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantize_input = quantize_input
        self.storage = storage  # release format of the weight: "fp8" (32x32 tiles) or "mxfp4"
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_input:
            x = fp8_qdq(x)
        return F.linear(x.to(self.weight.dtype), self.weight)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, quantize_input={self.quantize_input}, "
                f"storage={self.storage}")


class Linear(nn.Linear):
    """A bias-free projection stored unquantized (bf16 in the release); `dtype` fp32 where the reference
    computes in fp32 (the ratio > 1 compressor)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)
