"""Small building blocks shared by the model: RMSNorm and the release's quantized-input linear."""

import math

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


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] times bf16 weight [N, K]^T in fp32. On CUDA one bf16 GEMM with fp32 output: the same
    products (bf16 x bf16 is exact in fp32), without an fp32 copy of the weight."""
    if x.is_cuda:
        return torch.mm(x.flatten(0, -2), weight.t(), out_dtype=torch.float32).unflatten(0, x.shape[:-1])
    return F.linear(x.float(), weight.float())


def check_block_diagonal(op: str, x: torch.Tensor, weight: torch.Tensor, groups: int) -> None:
    """The shapes block_diagonal_linear takes, as errors that name `op` and the problem."""
    if groups < 1 or weight.shape[0] % groups:
        raise ValueError(f"{op}: {weight.shape[0]} outputs do not split into groups={groups}")
    if x.shape[-1] != groups * weight.shape[1]:
        raise ValueError(f"{op}: x has {x.shape[-1]} inputs, weight {tuple(weight.shape)} x groups={groups} takes "
                         f"{groups * weight.shape[1]}")


def block_diagonal_linear(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """x [..., groups * K] times weight [N, K]^T, group g's N / groups outputs reading only group g's inputs
    (the attention's grouped `wo_a`, hence an einsum); groups = 1 is F.linear."""
    if groups == 1:
        return F.linear(x, weight)
    z = torch.einsum("...gd,grd->...gr", x.unflatten(-1, (groups, -1)), weight.view(groups, -1, weight.shape[1]))
    return z.flatten(-2)


class QuantLinear(nn.Module):
    """A projection stored in the release as FP8 (32x32 tiles) or MXFP4: the weight is held here
    dequantized (exactly) in bf16, and with `quantize_input` the activation is FP8 quantize-dequantized
    in groups of 32 first, as the release's GEMMs do. The product accumulates in fp32, output bf16.
    groups > 1: block-diagonal (see block_diagonal_linear); in_features is then per group."""

    def __init__(self, in_features: int, out_features: int, quantize_input: bool = True, storage: str = "fp8",
                 groups: int = 1):
        super().__init__()
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.quantize_input = quantize_input
        self.storage = storage  # release format of the weight: "fp8" (32x32 tiles) or "mxfp4"
        self.few_rows = 0  # bf16 weights: inputs of at most this many rows run dsflash::bf16_linear (compile() sets it)
        self.gemv = False  # ... and one row dsflash::bf16_gemv (compile() sets it)
        self.qdq_op_rows = 0  # the input's FP8 as dsflash::fp8_qdq up to this many rows (compile() sets it)
        # bf16 inputs with a row count in this (first, last) range run dsflash::fp8_qdq then dsflash::bf16_linear
        # (compile() sets it for the long-K projections: custom_ops/bf16_linear.py's TALL_MIN_K)
        self.tall_rows: tuple[int, int] | None = None
        self.hold_weight()

    def hold_weight(self) -> None:
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows and x.numel() <= self.few_rows * x.shape[-1] and x.dtype == torch.bfloat16:  # decode
            one_row = self.gemv and x.numel() == x.shape[-1]
            op = torch.ops.dsflash.bf16_gemv if one_row else torch.ops.dsflash.bf16_linear
            return op(x, self.weight, self.groups, self.quantize_input)
        if self.tall_rows and self.tall_rows[0] * x.shape[-1] <= x.numel() <= self.tall_rows[1] * x.shape[-1] \
                and x.dtype == torch.bfloat16:
            x = torch.ops.dsflash.fp8_qdq(x) if self.quantize_input else x
            return torch.ops.dsflash.bf16_linear(x, self.weight, self.groups, False)
        if self.quantize_input and self.qdq_op_rows and x.numel() <= self.qdq_op_rows * x.shape[-1] \
                and x.dtype == torch.bfloat16:
            x = torch.ops.dsflash.fp8_qdq(x)
        elif self.quantize_input:
            x = fp8_qdq(x)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return block_diagonal_linear(x.to(self.weight.dtype), self.weight, self.groups)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, quantize_input={self.quantize_input}, "
                f"storage={self.storage}, groups={self.groups}")


class NativeQuantLinear(QuantLinear):
    """The same projection with its weight kept as the release stores it (config `weights="native"`): the
    checkpoint's bytes as buffers under the checkpoint's names, `weight` (E4M3 [out, in], or for "mxfp4"
    packed E2M1 int8 [out, in/2]) and `scale` (UE8M0: one per 32x32 tile, or per 32 inputs of a row). The
    product runs in the dsflash ops, which dequantize on the fly (exactly) and on CPU round as QuantLinear."""

    def hold_weight(self) -> None:
        rows, cols = self.out_features, self.in_features
        if self.storage == "mxfp4":
            if self.groups != 1:
                raise ValueError("NativeQuantLinear: MXFP4 weights (the routed experts) have no groups")
            weight = torch.empty(rows, cols // 2, dtype=torch.int8)
            scale = torch.empty(rows, math.ceil(cols / 32), dtype=torch.float8_e8m0fnu)
        else:
            weight = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
            scale = torch.empty(math.ceil(rows / 32), math.ceil(cols / 32), dtype=torch.float8_e8m0fnu)
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.storage == "fp8":
            return torch.ops.dsflash.fp8_block_linear(x, self.weight, self.scale, self.groups)
        rows = x.reshape(-1, x.shape[-1])  # one expert: a grouped product with a single group
        offsets = torch.full((1,), rows.shape[0], dtype=torch.int32, device=x.device)
        out = torch.ops.dsflash.mxfp4_grouped_mm(rows, self.weight[None], self.scale[None], offsets)
        return out.view(*x.shape[:-1], self.out_features)


def quant_linear(config, in_features: int, out_features: int, quantize_input: bool = True, storage: str = "fp8",
                 groups: int = 1) -> QuantLinear:
    """The projection class the config's `weights` asks for: bf16 (QuantLinear) or native (NativeQuantLinear)."""
    cls = NativeQuantLinear if config.native_weights else QuantLinear
    return cls(in_features, out_features, quantize_input, storage, groups)


def fuse_outputs(*linears: "QuantLinear | Linear") -> "QuantLinear | Linear":
    """One projection computing `linears` (same input and input quantization or dtype, no groups) concatenated along
    their outputs: one GEMM where there were several. Its tensors are buffers outside the checkpoint, and the
    linears' become views of their slices (no extra memory; names and checkpoints unchanged; see view_outputs)."""
    first, outputs = linears[0], sum(m.out_features for m in linears)
    layouts = {(type(m), m.in_features, m.weight.dtype, getattr(m, "quantize_input", None), getattr(m, "storage", None),
                getattr(m, "groups", 1)) for m in linears}
    if (len(layouts) > 1 or getattr(first, "groups", 1) != 1
            or any(m.out_features % _rows_per_scale(m, "scale") for m in linears)):
        raise ValueError(f"fuse_outputs: these projections do not share an input layout: {linears}")
    with torch.device("meta"):
        if isinstance(first, Linear):
            fused = Linear(first.in_features, outputs, first.weight.dtype)
        else:
            fused = type(first)(first.in_features, outputs, first.quantize_input, first.storage)
    for leaf in _leaves(first):
        delattr(fused, leaf)
        fused.register_buffer(leaf, torch.cat([getattr(m, leaf).detach() for m in linears]), persistent=False)
    view_outputs(fused, linears)
    return fused


def keep_fused(fused: "QuantLinear | Linear | None", linears, fuse: bool) -> "QuantLinear | Linear | None":
    """The projection fusing `linears` to hold (fuse_outputs; None with fuse off): `fused` itself while the linears'
    tensors are still its views (graphs captured before read them), a new one after a load replaced one of them."""
    if fuse and fused is not None and still_views(fused, linears):
        return fused
    return fuse_outputs(*linears) if fuse else None


def view_outputs(fused: QuantLinear, linears) -> None:
    """Point each of `linears`' tensors at its slice of fused's (after fuse_outputs, or a move of the model)."""
    for leaf in _leaves(fused):
        sizes = [m.out_features // _rows_per_scale(m, leaf) for m in linears]
        for m, t in zip(linears, getattr(fused, leaf).split(sizes)):
            hold(m, leaf, t)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def still_views(fused: QuantLinear, linears) -> bool:
    """Whether every tensor of `linears` is still a view of fused's (no load or assignment replaced one)."""
    return all(same_storage(getattr(m, leaf), getattr(fused, leaf)) for leaf in _leaves(fused) for m in linears)


def hold(linear: nn.Module, leaf: str, t: torch.Tensor) -> None:
    """Make `t` (a view of a fused or stacked tensor) the linear's tensor `leaf`, as the parameter or buffer it is."""
    if leaf in linear._parameters:
        setattr(linear, leaf, nn.Parameter(t, requires_grad=False))
    else:
        setattr(linear, leaf, t)


def _leaves(linear: QuantLinear) -> tuple[str, ...]:
    return ("weight", "scale") if isinstance(linear, NativeQuantLinear) else ("weight",)


def _rows_per_scale(linear: QuantLinear, leaf: str) -> int:
    """Output rows per row of the tensor `leaf`: native FP8 scales cover 32x32 tiles."""
    return 32 if leaf == "scale" and isinstance(linear, NativeQuantLinear) and linear.storage == "fp8" else 1


class Linear(nn.Linear):
    """A bias-free projection stored unquantized (bf16 in the release); `dtype` fp32 where the reference
    computes in fp32 (the ratio > 1 compressor)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.gemv = False  # one row runs dsflash::bf16_gemv, or for fp32 weights dsflash::fp32_gemv (compile() sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and x.numel() == x.shape[-1]:
            if self.weight.dtype == torch.float32:  # x widened as it is read
                return torch.ops.dsflash.fp32_gemv(x, self.weight)
            if x.dtype == self.weight.dtype == torch.bfloat16:
                return torch.ops.dsflash.bf16_gemv(x, self.weight, 1, False)
        return F.linear(x.to(self.weight.dtype), self.weight)
