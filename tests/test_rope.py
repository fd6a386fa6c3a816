"""rope.apply_rope against complex multiplication (an independent oracle), and its inverse."""

import torch

from dsflash_compile.rope import apply_rope, inverse_frequencies, rotation


def test_rotation_is_complex_multiplication():
    x = torch.randn(2, 5, 3, 48, dtype=torch.float64).float()  # [batch, T, heads, d], rope on the last 16
    positions = torch.arange(10).view(2, 5) * 7
    rot = rotation(positions, inverse_frequencies(16, 10000.0))
    got = apply_rope(x, rot)
    angles = positions.double().unsqueeze(-1) * inverse_frequencies(16, 10000.0).double()
    turned = torch.view_as_complex(x[..., -16:].double().unflatten(-1, (-1, 2)).contiguous()) \
        * torch.polar(torch.ones_like(angles), angles).unsqueeze(-2)
    assert torch.equal(got[..., :-16], x[..., :-16])
    torch.testing.assert_close(got[..., -16:].double(), torch.view_as_real(turned).flatten(-2), rtol=0,
                               atol=1e-5)  # fp32 angles
    torch.testing.assert_close(apply_rope(got, rot, inverse=True), x, rtol=1e-6, atol=1e-6)
