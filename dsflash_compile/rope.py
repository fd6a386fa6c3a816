"""Rotary embeddings: interleaved pairs (2i, 2i+1) on the trailing `r` dims, with YaRN for compressed layers.

Angles are computed from positions on the fly (positions * inverse frequency, fp32, then `torch.polar`),
so there is no table sized by the 1M-token context and any per-row position works.
"""

import math

import torch


def inverse_frequencies(rope_dim: int, theta: float, yarn: dict | None = None) -> torch.Tensor:
    """fp32 [rope_dim / 2]. With `yarn`, the band between beta_fast and beta_slow rotations over the
    original context is faded linearly from f to f / factor (MODEL.md section 4, no temperature)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn:
        original = yarn["original_max_position_embeddings"]

        def correction_dim(rotations: float) -> float:
            return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
        high = min(math.ceil(correction_dim(yarn["beta_slow"])), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / yarn["factor"] * ramp + freqs * (1 - ramp)
    return freqs


# rotation's cos / sin by torch.cos / torch.sin instead of torch.polar: Inductor has no code for complex tensors, so
# a compiled decode step runs each polar as an eager aten kernel (three in the set-up, ~2 us each with its launch
# gap on the H200); cos / sin fuse into the angles' kernel. Off until a B1 step on the H200 shows the same logits
# (the GPU's polar takes cosf / sinf; whether Inductor's cos / sin give the same bits there is not known) and less
# time (compile_and_profile variant rope-cos-sin; written in a session without a GPU). On the CPU they may differ
# in the last bit (vectorized against scalar code)
COS_SIN = False


def rotation(positions: torch.Tensor, inverse_freq: torch.Tensor) -> torch.Tensor:
    """fp32 [..., rope_dim / 2, 2]: (cos, sin) of position * f, taken from `torch.polar` (the reference's
    values, to the bit; COS_SIN: torch.cos / torch.sin). Real pairs rather than a complex tensor, so compiled
    graphs stay real-valued (Inductor does not generate code for complex arithmetic). Negative positions
    (padding) give any value."""
    angles = positions.float().unsqueeze(-1) * inverse_freq
    if COS_SIN:
        return torch.stack([angles.cos(), angles.sin()], dim=-1)
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles))


def apply_rope(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2 * rot.shape[-2] dims of x ([..., T, d] or [..., T, heads, d]) in fp32.

    `rot` is [..., T, r/2, 2] from `rotation`; each pair (x0, x1) becomes the complex product
    (x0 + i x1)(cos + i sin), written out in real arithmetic; `inverse` applies the conjugate rotation
    (how the attention output drops the query's rotation, since V = K carries it). Returns x's dtype;
    the leading dims are untouched.
    """
    r = 2 * rot.shape[-2]
    if x.dim() == rot.dim():  # a heads dim sits between T and d
        rot = rot.unsqueeze(-3)
    cos, sin = rot[..., 0], rot[..., 1]
    if inverse:
        sin = -sin
    pairs = x[..., -r:].float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    tail = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-r], tail], dim=-1)
