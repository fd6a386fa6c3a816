"""Random initialisation for the presets (no checkpoint): small, finite, and on the release's storage grids.

Quantized projections are snapped to their release format (FP8 32x32 tiles or MXFP4) and the Engram
table is drawn as FP8 codes, so a random model saves and reloads bit-exactly like a real checkpoint.
"""

import torch
from torch import nn

from . import formats
from .configuration_deepseek_v41 import DeepseekV41TextConfig
from .layers import Linear, NativeQuantLinear, QuantLinear, RMSNorm


@torch.no_grad()
def encode_to_storage(weight: torch.Tensor, storage: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` in its release format: (codes, UE8M0 scales), FP8 32x32 tiles or MXFP4."""
    return (formats.quant_mxfp4 if storage == "mxfp4" else formats.quant_fp8_block)(weight.float())


@torch.no_grad()
def snap_to_storage(weight: torch.Tensor, storage: str) -> torch.Tensor:
    """The nearest value of `weight` representable in its release format (bf16)."""
    return (formats.dequant_mxfp4 if storage == "mxfp4" else formats.dequant_fp8_block)(*encode_to_storage(weight, storage))


@torch.no_grad()
def init_module(module: nn.Module, config: DeepseekV41TextConfig) -> None:
    from .engram import Engram, EngramTable  # local: avoid an import cycle with the model files

    std = config.initializer_range
    if module.__class__.__name__ == "DeepseekV41Block":
        for seam in ("attn", "ffn"):
            getattr(module, f"hc_{seam}_fn").normal_(0, std)
            base = getattr(module, f"hc_{seam}_base")
            base.zero_()
            hc = config.hc_mult
            base[2 * hc:].view(hc, hc).fill_diagonal_(1.0)  # comb starts near the identity
            getattr(module, f"hc_{seam}_scale").fill_(1.0)
    elif isinstance(module, NativeQuantLinear):  # the same draws as QuantLinear's, kept encoded
        draw = torch.randn(module.out_features, module.in_features, device=module.weight.device) * std
        weight, scale = encode_to_storage(draw, module.storage)
        module.weight.copy_(weight)
        module.scale.copy_(scale)
    elif isinstance(module, QuantLinear):
        module.weight.copy_(snap_to_storage(torch.randn_like(module.weight, dtype=torch.float32) * std, module.storage))
    elif isinstance(module, (Linear, nn.Linear, nn.Embedding)):
        # bf16 values even where the reference computes in fp32 (the compressor): the release stores bf16
        module.weight.copy_(torch.randn_like(module.weight, dtype=torch.float32).mul_(std).bfloat16())
    elif isinstance(module, RMSNorm):
        module.weight.fill_(1.0)
    elif isinstance(module, EngramTable):
        codes, scale = formats.quant_fp8_rows(torch.randn(module.weight.shape))
        module.weight.copy_(codes)
        module.scale.copy_(scale)
    elif isinstance(module, Engram):
        module.q_weight.fill_(1.0)
        module.k_weight.fill_(1.0)
    if hasattr(module, "attn_sink"):
        module.attn_sink.zero_()
    if module.__class__.__name__ == "Gate":
        module.weight.normal_(0, std)
        module.bias.zero_()
        module.bias_vl.zero_()
