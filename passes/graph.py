"""Small FX helpers the passes share."""

import operator

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode


def insert_call(graph: torch.fx.Graph, op, args: tuple, outputs: int):
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
