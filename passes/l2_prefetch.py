"""Weights into L2 ahead of their projection (issue 5): for each projection that streams a weight, the kernels
between it and the projection before it are bound by latency and leave HBM idle; dsflash::l2_prefetch
(custom_ops/l2_prefetch.py) pulls the weight's first bytes into L2 while they run.

For a projection G (STREAMED: a dsflash op and the weight it streams) and the weight-streaming node P before it in
graph order (any node reading graph inputs of at least STREAM_MIN_BYTES, through views), the window is the nodes
computed from P that G is computed from: they run after P's end and before G's start. Its first dsflash op (in
graph order) whose kernel waits before working is the anchor: the prefetch goes right after it, declared as
writing the anchor's output (so Inductor keeps it there, before the output's readers). Its kernel is scheduled
beside the anchor's, once P has finished (pdl.py), and prefetches while the window runs. G first in the graph:
any such op G is computed from. A window with no dsflash op (wq_b after the query's norm, wo_b after wo_a, the
down projection after up) gets no prefetch.

nbytes: the weight's first max_bytes at most (the L2 of the H200 holds 50 MB, and the window's own kernels use
some). The routed experts' op prefetches only the shared expert's up projection (w1's last slice when the
shared expert is stacked): which routed experts run is known only once the router has run.
"""

import operator

import torch

from .graph_edit import ancestors, call, descendants, dsflash_op, is_view, starts_early

ops = torch.ops.dsflash
# Nodes reading less of the graph's inputs (an mHC seam's fn, 2 MB at release size; the release router's gate,
# 3.9 MB) take ~2 us of HBM at most: they can be anchors, and weights that small are not prefetched
STREAM_MIN_BYTES = 8 << 20


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _graph_input(node: torch.fx.Node) -> torch.fx.Node | None:
    while is_view(node):
        node = node.args[0]
    return node if node.op in ("placeholder", "get_attr") else None


def _projection_weight(node: torch.fx.Node) -> tuple[torch.fx.Node, int | None] | None:
    """What a STREAMED op streams first: (weight, None), or (stack, slice) for the shared expert's w1; None if
    unknown before the op runs."""
    if node.target in (ops.bf16_gemv.default, ops.bf16_linear.default):
        return node.args[1], None
    if node.target is ops.routed_experts.default and node.args[9] >= 0:
        return node.args[3], node.args[9]
    return None


def _streams(node: torch.fx.Node) -> bool:
    """Whether the node reads graph inputs (weights) of at least STREAM_MIN_BYTES."""
    inputs = {_graph_input(n) for n in node.all_input_nodes} - {None}
    return node.op == "call_function" and not is_view(node) and sum(map(_nbytes, inputs)) >= STREAM_MIN_BYTES


def _anchor_output(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor a dsflash op's kernel writes first: the node itself, or the item of its first tensor output
    (for a functionalized op, the first input it writes)."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        return node
    items = sorted((u for u in node.users if u.target is operator.getitem), key=lambda u: u.args[1])
    return next((u for u in items if isinstance(u.meta.get("val"), torch.Tensor)), None)


class L2PrefetchPass:
    name = "l2_prefetch"

    def __init__(self, max_bytes: int):
        """Prefetch at most max_bytes of each projection's weight."""
        self.options = {"max_bytes": max_bytes}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Insert a prefetch for every STREAMED projection with a window; returns how many."""
        order = {n: i for i, n in enumerate(graph.nodes)}
        count, previous = 0, None
        for node in list(graph.nodes):
            if node.op != "call_function" or not _streams(node):
                continue
            count += self._prefetch(graph, node, previous, order)
            previous = node
        return count

    def _prefetch(self, graph, node, previous, order) -> int:
        streamed = _projection_weight(node) if node.target in _STREAMED else None
        if streamed is None:
            return 0
        weight, index = streamed
        size = _nbytes(weight) // (weight.meta["val"].shape[0] if index is not None else 1)
        if size < STREAM_MIN_BYTES:
            return 0
        window = ancestors(node) & (descendants(previous) if previous is not None else set(order))
        anchors = [n for n in window if n in order and dsflash_op(n) is not None and not starts_early(n)
                   and not _streams(n) and _anchor_output(n) is not None]
        if not anchors:
            return 0
        anchor = _anchor_output(min(anchors, key=order.__getitem__))
        with graph.inserting_before(anchor.next):  # the slice, then the prefetch
            if index is not None:
                weight = call(graph, torch.ops.aten.select.int, (weight, 0, index), 0)
            call(graph, ops.l2_prefetch.default, (anchor, weight, min(size, self.options["max_bytes"]), True), 0)
        return 1


_STREAMED = (ops.bf16_gemv.default, ops.bf16_linear.default, ops.routed_experts.default)
