"""Small FX graph edits the passes share: the fused seams and their arguments, a static token count, an op call
with its fake value, views and readers (and moving views), descendants, and which nodes' kernels start before
their PDL wait."""

import math
import operator
from types import SimpleNamespace

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

ops = torch.ops.dsflash


def fused_seams(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's dsflash::mhc_seam nodes, then its dsflash::mhc_entry_seam nodes."""
    return [node for target in (ops.mhc_seam.default, ops.mhc_entry_seam.default)
            for node in graph.find_nodes(op="call_function", target=target)]


def seam_arguments(node: torch.fx.Node) -> SimpleNamespace:
    """A fused seam's arguments as attributes named as in its schema; out, post and comb None for an entry seam."""
    names = [argument.name for argument in node.target._schema.arguments]
    return SimpleNamespace(**{"out": None, "post": None, "comb": None, **dict(zip(names, node.args, strict=True))})


def static_tokens(streams: torch.fx.Node) -> int | None:
    """Tokens of a seam's streams [..., hc, D], or None if not a static count."""
    lead = streams.meta["val"].shape[:-2]
    return math.prod(lead) if all(isinstance(n, int) for n in lead) else None


def call(graph: torch.fx.Graph, op, args: tuple, outputs: int):
    """Insert op(*args) (at the graph's insertion point) with its fake value; its `outputs` getitems."""
    vals = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    fake_mode = detect_fake_mode(vals) or FakeTensorMode()
    with fake_mode:
        val = op(*vals)
    node = graph.call_function(op, args)
    node.meta["val"] = val
    if not outputs:
        return node
    items = []
    for i in range(outputs):
        item = graph.call_function(operator.getitem, (node, i))
        item.meta["val"] = val[i]
        items.append(item)
    return items


def linear_calls(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's dsflash::bf16_linear and dsflash::bf16_gemv calls (the projections a decode row runs)."""
    return [node for op in (torch.ops.dsflash.bf16_linear.default, torch.ops.dsflash.bf16_gemv.default)
            for node in graph.find_nodes(op="call_function", target=op)]


def is_view(node: torch.fx.Node) -> bool:
    """A node that only reinterprets its input (no kernel reads data); post-grad graphs spell views reshape."""
    return node.op == "call_function" and (node.target is torch.ops.aten.reshape.default
                                           or getattr(node.target, "is_view", False))


def source(node: torch.fx.Node) -> torch.fx.Node:
    """The node that computed `node`'s data: up through views and the items of view ops (a split's pieces)."""
    while is_view(node) or (node.target is operator.getitem and is_view(node.args[0])):
        node = node.args[0]
    return node


def views_and_readers(items: list[torch.fx.Node]) -> tuple[set, set]:
    """The views taken of `items` (transitively) and the nodes that read them or their views."""
    views, readers, todo = set(), set(), list(items)
    while todo:
        for user in todo.pop().users:
            if is_view(user):
                if user not in views:
                    views.add(user)
                    todo.append(user)
            else:
                readers.add(user)
    return views, readers


def move_views_before(views: set, reader: torch.fx.Node, order: dict) -> None:
    """Move the views placed before `reader` (by `order`, positions of the graph's nodes) right before it, in
    their order: views of outputs now computed by a node inserted before the reader."""
    for view in sorted(views, key=order.__getitem__):
        if order[view] < order[reader]:
            reader.prepend(view)


def descendants(node: torch.fx.Node) -> set:
    """The nodes computed from `node`'s outputs."""
    seen, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def op_arguments(node: torch.fx.Node) -> dict:
    """An op call's arguments by its schema's names (given ones only); {} for anything but an op call."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return {}
    names = [argument.name for argument in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def mutated(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose data `node` writes in place: the arguments its op's schema marks as written (Tensor(a!))."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return []
    given, written = op_arguments(node), []
    for argument in node.target._schema.arguments:
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = given.get(argument.name)
            written += [v for v in (value if isinstance(value, (list, tuple)) else [value])
                        if isinstance(v, torch.fx.Node)]
    return written


def starts_early(node: torch.fx.Node) -> bool:
    """A node (or an item of one) whose kernel works before its PDL wait (custom_ops/pdl.py): an op called with
    its `early` argument on. Such a kernel cannot be the one an early op needs between its inputs' producers
    and itself."""
    if node.target is operator.getitem:
        node = node.args[0]
    return bool(op_arguments(node).get("early", False))
