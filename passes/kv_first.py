"""Key row first (issue 5): the attention's key/value row (dsflash::kv_norm_rope and its ring-writing form)
is made before the query's projection (wq_b), whose one-row `dsflash::bf16_gemv` takes the row as its `after` (never
read): Inductor otherwise issues the row's kernel right before the attention, between wq_b and it (12-04 d5 trace). With
the row first, the attention's kernel follows wq_b's, a GEMV of 84 MB whose programs leave the SMs one by one: the
attention's programs (one an SM) are placed on the SMs its tail frees and, with `attention_triton.PREFETCH_KEYS`, ask
L2 for their key records there before their PDL wait. The same ops in another order: the same values.
"""

import operator

import torch

from .graph_edit import op_arguments, source

ops = torch.ops.dsflash
ROW_OPS = (ops.kv_norm_rope.default, ops.kv_norm_rope_write_.default)  # (the joint ones also make wq_b's input)


def _attention_args(node: torch.fx.Node) -> dict | None:
    """The attention_'s arguments by name: the op itself or its functional form in a post-grad graph."""
    if node.target is ops.attention_.default:
        return op_arguments(node)
    if node.target is torch.ops.higher_order.auto_functionalized_v2 and node.args[0] is ops.attention_.default:
        return dict(node.kwargs)
    return None


def _projection(q: torch.fx.Node) -> torch.fx.Node | None:
    """The one-row bf16_gemv that computed the query `q`, through views and in-place ops on its output (a RoPE not
    folded into its epilogue: a functionalized op's item i >= 1 is its base i - 1), else None."""
    node = source(q)
    while node.target is operator.getitem and node.args[0].target is torch.ops.higher_order.auto_functionalized_v2:
        item, af = node.args[1], node.args[0]
        if item < 1:
            return None
        node = source(af.kwargs["_all_bases"][item - 1])
    return node if node.target is ops.bf16_gemv.default else None


def _kernel(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose kernel computed `node` (an item of a multi-output or functionalized op: that op)."""
    node = source(node)
    return node.args[0] if node.target is operator.getitem else node


class KvFirstPass:
    name = "kv_first"

    def __init__(self):
        self.options = {}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Order each attention's key row before its query's one-row projection; returns how many."""
        ordered = 0
        for node in list(graph.nodes):
            args = _attention_args(node)
            if args is None or not isinstance(args.get("q"), torch.fx.Node):
                continue
            query, row = _projection(args["q"]), args.get("chunk_kv")
            if (query is None or query.kwargs.get("after") is not None or not isinstance(row, torch.fx.Node)
                    or _row_op(_kernel(row)) is None):
                continue
            row = source(row)  # the row op's output (or, functionalized, its item)
            kernel, order = _kernel(row), {n: i for i, n in enumerate(graph.nodes)}
            if any(order[i] > order[query] for i in kernel.all_input_nodes):
                continue  # (an input made after the query: left as it is)
            if order[kernel] > order[query]:  # up to right before the query, its item right after it
                query.prepend(kernel)
                if row is not kernel:
                    query.prepend(row)
            query.kwargs = {**query.kwargs, "after": row}
            ordered += 1
        return ordered


def _row_op(node: torch.fx.Node):
    """The key row op `node` runs (directly or functionalized), else None."""
    target = node.args[0] if node.target is torch.ops.higher_order.auto_functionalized_v2 else node.target
    return target if target in ROW_OPS else None
