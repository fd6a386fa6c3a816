"""Linear + RoPE (issue 5): a `dsflash::bf16_linear` or `dsflash::bf16_gemv` (one row: QuantLinear's decode batch 1)
whose only reader is `dsflash::rope_` on its output viewed as heads (the attention's query: wq_b, then the RoPE of
each head's tail) becomes the same op with the rotation in its epilogue (`rot`, `head_dim`), so the decode step
loses the RoPE's launch (bf16_gemv's kernel takes weights of up to ~24 MB: wq_b's 84 MB runs bf16_linear's, whose
kernels rotate in their epilogue, at one row the TMA kernel's; a smaller weight would run the RoPE's kernel after
the GEMV).

In the post-grad graph the in-place rope_ is functionalized: auto_functionalized_v2(rope_, rot=..., _x_base_index=0,
_x_size=(..., heads, head_dim), _all_bases=[linear]) and its item 1 is the rotated base. The pass takes only the
plain case: the base is the linear's whole output viewed contiguously (offset 0, the linear's shape with its last
dim split into heads), the linear has no other reader and the rotation's item 1 is the only item read. Item 1's
readers then read the new linear, whose output is the rotated base: the two kernels' arithmetic
(bf16_linear_triton._finish_tile rotates as rope_tail_triton.py does), within one bf16 ulp of their bits where the
compiler contracts the products into other FMAs (H200: equal at one row in the CUDA test, yet the B1 step's logits
were not bit-equal, 12-03 a3, with wq_b then on the tiled kernel). On by default (CompileOptions.linear_rope) since
the TMA kernel rotates too: H200 B1 step 10.153 ms against 10.186, logits bit-equal (12-04 d4).
"""

import operator

import torch

from .graph_edit import call, linear_calls

ops = torch.ops.dsflash


def _rotation_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The auto_functionalized rope_ whose only base is `node` viewed whole as heads, else None."""
    if len(node.users) != 1:
        return None
    (af,) = node.users
    if (af.target is not torch.ops.higher_order.auto_functionalized_v2 or af.args[0] is not ops.rope_.default
            or af.kwargs.get("_all_bases") != [node] or af.kwargs.get("_x_base_index") != 0
            or af.kwargs.get("_x_storage_offset", 0) != 0):
        return None
    out = node.meta["val"]
    size, stride = af.kwargs.get("_x_size"), af.kwargs.get("_x_stride")
    if size is None or len(size) != out.dim() + 1 or tuple(size[:-2]) != tuple(out.shape[:-1]):
        return None
    heads, head_dim = size[-2], size[-1]
    if heads * head_dim != out.shape[-1] or tuple(stride[-2:]) != (head_dim, 1):
        return None
    if any(user.target is not operator.getitem or user.args[1] != 1 for user in af.users):
        return None
    return af


class LinearRopePass:
    name = "linear_rope"

    def __init__(self):
        self.options = {}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Fold every plain rope_ of a bf16_linear's heads into the linear; returns how many."""
        folded = 0
        for linear in linear_calls(graph):
            af = _rotation_of(linear)
            if af is None or len(linear.args) > 4:  # (a linear with its epilogue already)
                continue
            rot, x = af.kwargs["rot"], linear.args[0]
            if tuple(rot.meta["val"].shape[:-2]) != tuple(x.meta["val"].shape[:-1]):
                continue
            with graph.inserting_before(af):
                fused = call(graph, linear.target, (*linear.args, rot, af.kwargs["_x_size"][-1]), outputs=0)
            for item in list(af.users):
                item.replace_all_uses_with(fused)
                graph.erase_node(item)
            graph.erase_node(af)
            graph.erase_node(linear)
            folded += 1
        return folded
