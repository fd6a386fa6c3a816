"""Linear norm (issue 5): an RMSNorm (layers.RMSNorm, as the post-grad graph spells it) whose only reader is a
one-row `dsflash::bf16_linear` or `dsflash::bf16_gemv` of a weight bf16_linear's TMA kernel takes (the attention's
wq_b at decode batch 1, reading the query's norm) becomes that projection's norm prologue: bf16_gemv with
`norm_weight`, `norm_eps`, whose CUDA kernel (bf16_linear_tma_triton.py's NORM) takes x's sum of squares in every
program and norms x as it loads it. The decode step loses the norm's launch (Inductor's reduction, 1.2 us of the
B1 step's path a layer on the H200, 12-04 d4).

    c = convert(x, f32);  qr = convert(convert(w, f32) * (c * rsqrt(mean(c ** 2, [-1], keepdim) + eps)), bf16)
    y = bf16_linear(qr, W, 1, q[, rot, head_dim])      =>      y = bf16_gemv(x, W, 1, q, rot, head_dim, w, eps)

Where the normed row has other readers (an index source's indexer reads the query's norm too) the norm stays.
The row's sum of squares adds in another order than Inductor's, so the normed row may differ by a bf16 ulp.
Off by default (CompileOptions.linear_norm): on the H200 the B1 step took 10.237 ms with it against 10.084 (12-04
d5), wq_b 27.7 us of a layer's path against 22.7 for the norm's kernel and wq_b, when the prologue's sum of squares
looped over the row's tiles (a round trip each); it loads the whole row at once since (NORM_ROW), not measured.
"""

import torch

from .graph_edit import call, linear_calls

try:  # Triton is optional on CPU machines: there no projection takes the TMA kernel and nothing is folded
    from dsflash_compile.custom_ops import bf16_linear_tma_triton as tma
except ImportError:  # pragma: no cover - CPU machines without triton
    tma = None

ops = torch.ops.dsflash
aten, prims = torch.ops.aten, torch.ops.prims


def _is(node, target, *args) -> bool:
    """node is call_function(target, *args...) (args given: a prefix of its args, nodes or constants)."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target
            and tuple(node.args[:len(args)]) == args)


def _rms_norm(node: torch.fx.Node):
    """(x, weight, eps, its nodes from `node` up) of the layers.RMSNorm that computed `node`, if its nodes are read
    by nothing else (the weight's fp32 copy aside)."""
    if not _is(node, prims.convert_element_type.default) or node.args[1] is not torch.bfloat16:
        return None
    prod = node.args[0]
    if not _is(prod, aten.mul.Tensor) or len(prod.users) != 1:
        return None
    w32, scaled = prod.args
    if not (_is(w32, prims.convert_element_type.default) and _is(scaled, aten.mul.Tensor)) or len(scaled.users) != 1:
        return None
    x32, rsqrt = scaled.args
    if not (_is(x32, prims.convert_element_type.default) and _is(rsqrt, aten.rsqrt.default)) or len(rsqrt.users) != 1:
        return None
    add = rsqrt.args[0]
    if not _is(add, aten.add.Tensor) or len(add.users) != 1 or not isinstance(add.args[1], float):
        return None
    mean = add.args[0]
    if not _is(mean, aten.mean.dim) or len(mean.users) != 1 or list(mean.args[1]) != [-1] or not mean.args[2]:
        return None
    square = mean.args[0]
    if not _is(square, aten.pow.Tensor_Scalar, x32, 2) or len(square.users) != 1 or len(x32.users) != 2:
        return None
    x, weight = x32.args[0], w32.args[0]
    if x.meta["val"].dtype != torch.bfloat16 or weight.meta["val"].dtype != torch.bfloat16:
        return None
    if tuple(weight.meta["val"].shape) != (x.meta["val"].shape[-1],):
        return None
    return x, weight, add.args[1], [node, prod, w32, scaled, rsqrt, add, mean, square, x32]


class LinearNormPass:
    name = "linear_norm"

    def __init__(self):
        self.options = {}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Fold every RMSNorm read only by a one-row TMA-sized projection into it; returns how many."""
        folded = 0
        for linear in linear_calls(graph):
            normed, weight, groups = linear.args[:3]
            if len(linear.args) > 6 or groups != 1 or len(normed.users) != 1:  # (a norm already given)
                continue
            row, (n, k) = normed.meta["val"], weight.meta["val"].shape
            if (tma is None or row.numel() != row.shape[-1] or not tma.takes_shape(n, k, groups)
                    or not tma.takes_norm(k, groups)):
                continue
            norm = _rms_norm(normed)
            if norm is None:
                continue
            x, norm_weight, eps, nodes = norm
            rot, head_dim = (linear.args[4:6] if len(linear.args) > 4 else (None, 0))
            with graph.inserting_before(linear):
                fused = call(graph, ops.bf16_gemv.default,
                             (x, weight, groups, linear.args[3], rot, head_dim, norm_weight, eps), outputs=0)
            linear.replace_all_uses_with(fused)
            graph.erase_node(linear)
            for node in nodes:  # readers first
                if not node.users:
                    graph.erase_node(node)
            folded += 1
        return folded
