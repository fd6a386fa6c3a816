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


def test_cos_sin_rotation_is_polar_within_an_ulp(monkeypatch):
    """rope.COS_SIN (off by default): torch.cos / torch.sin give torch.polar's values within an fp32 ulp on the CPU
    (vectorized against scalar code), at positions up to 1M."""
    from dsflash_compile import rope

    positions = torch.cat([torch.arange(5000), torch.randint(0, 1 << 20, (5000,))]).view(2, -1)
    freqs = inverse_frequencies(64, 10000.0)
    polar = rotation(positions, freqs)
    monkeypatch.setattr(rope, "COS_SIN", True)
    torch.testing.assert_close(rotation(positions, freqs), polar, rtol=0, atol=2.4e-7)
