"""Linear x scale (passes/linear_scale.py): a one-row dsflash::bf16_gemv whose only reader multiplies it by a
constant takes the constant in its epilogue (`out_scale`), with the multiply's bits; anything else is left alone."""

import pytest
import torch

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.passes import LinearScalePass
from test_mhc_fusion import compiling  # noqa: F401  (a fixture)

ops = torch.ops.dsflash
SCALE = 128 ** -0.5 * 32 ** -0.5  # the indexer's weights' scale at the release shape


class Recorded:
    """Post-grad pass: LinearScalePass, with its count and each bf16_gemv's out_scale."""

    def __init__(self):
        self.scale, self.counts, self.scales = LinearScalePass(), [], []

    def __call__(self, graph):
        self.counts.append(self.scale.apply(graph))
        self.scales += [n.kwargs.get("out_scale", 1.0)
                        for n in graph.find_nodes(op="call_function", target=ops.bf16_gemv.default)]


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 1, 64, generator=g).bfloat16(), (torch.randn(32, 64, generator=g) / 8).bfloat16()


def weights_like(x, w):
    """The indexer's weights: a plain projection of the row times a constant, read by a later op."""
    return torch.sigmoid((ops.bf16_gemv(torch.tanh(x.float()).bfloat16(), w, 1, False) * SCALE).float())


def test_a_constant_multiply_folds_into_the_gemv(compiling):  # noqa: F811
    recorded = Recorded()
    got = compiling(recorded, weights_like)(*inputs())
    assert recorded.counts == [1] and recorded.scales == [pytest.approx(SCALE)]
    assert torch.equal(got, weights_like(*inputs()))  # the CPU reference: the multiply's bits


@pytest.mark.parametrize("case", ["two readers", "a tensor factor", "an fp32 product"])
def test_other_multiplies_are_left_alone(compiling, case):  # noqa: F811
    def fn(x, w):
        y = ops.bf16_gemv(torch.tanh(x.float()).bfloat16(), w, 1, False)
        if case == "two readers":
            return y * SCALE, y.float().sum()
        if case == "a tensor factor":
            return y * x[..., :32]
        return y.float() * SCALE

    recorded = Recorded()
    compiling(recorded, fn)(*inputs())
    assert recorded.counts == [0] and recorded.scales == [1.0]


def test_the_op_scales_after_the_rope():
    """out_scale with the RoPE epilogue: the rotated output times the scale (the reference's order)."""
    x, w = inputs()
    w = w.repeat(2, 1)  # 64 outputs: 2 heads of 32, their last 8 pairs rotated
    rot = torch.randn(1, 1, 8, 2)
    rotated = ops.bf16_gemv(x, w, 1, True, rot, 32)
    assert torch.equal(ops.bf16_gemv(x, w, 1, True, rot, 32, out_scale=0.3), rotated * 0.3)
