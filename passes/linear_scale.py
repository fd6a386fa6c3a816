"""Linear x scale (issue 5): a one-row `dsflash::bf16_gemv` whose only reader multiplies it by a constant becomes the
same op with the constant in its epilogue (`out_scale`): the indexer's weights_proj(x) * head_dim^-1/2 * heads^-1/2.
The GEMV's kernel rounds its sums to bf16, multiplies in fp32 and rounds to bf16 again, as the multiply does on the
GEMV's bf16 output: the same bits. The decode step loses the multiply's kernel, one an index layer (8 a flash-40l-e8
B1 step: in the 12-04 d5 trace fused with the visible counts, ~0.5-1.6 us of the path each; those counts are made in
the set-up since).
"""

import torch

ops = torch.ops.dsflash


def _scale_of(gemv: torch.fx.Node) -> float | None:
    """The constant that the only reader of `gemv`'s bf16 output multiplies it by, else None."""
    if len(gemv.users) != 1:
        return None
    (mul,) = gemv.users
    if mul.target is not torch.ops.aten.mul.Tensor or len(mul.args) != 2 or mul.kwargs:
        return None
    other = mul.args[1] if mul.args[0] is gemv else mul.args[0]
    if not isinstance(other, float) or mul.meta["val"].dtype != torch.bfloat16:
        return None
    return other


class LinearScalePass:
    name = "linear_scale"

    def __init__(self):
        self.options = {}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Fold every constant multiply of a one-row GEMV's output into the GEMV; returns how many."""
        folded = 0
        for gemv in graph.find_nodes(op="call_function", target=ops.bf16_gemv.default):
            scale = _scale_of(gemv)
            if scale is None or gemv.kwargs.get("out_scale", 1.0) != 1.0:
                continue
            (mul,) = gemv.users
            gemv.kwargs = {**gemv.kwargs, "out_scale": scale}
            mul.replace_all_uses_with(gemv)
            graph.erase_node(mul)
            folded += 1
        return folded
