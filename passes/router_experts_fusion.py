"""Router-experts fusion: `fused_router` whose routing feeds `routed_experts` of the same tokens, with the shared
expert stacked, becomes one `dsflash::routed_moe` call (custom_ops/routed_moe.py: on CUDA the shared expert's up
projection runs beside the router, which it does not depend on).

    weights, ids = fused_router(x, gate, bias, topk, normalize, scale)      y, weights, ids = routed_moe(x, gate,
    y = routed_experts(x, weights, ids, w1, w3, w2, limit,             =>       bias, topk, normalize, scale, w1,
                       quantize_x, quantize_h, shared, out_bf16)                w3, w2, limit, quantize_x,
                                                                                quantize_h, shared, out_bf16)

Runs after the gating fusion (which makes the `fused_router` calls). The fused call goes where `routed_experts`
was; a routing read by anything between the two calls keeps the graph as it is, as does a call without a shared
expert (nothing would run beside the router).
"""

import operator

import torch

from .graph import insert_call

ops = torch.ops.dsflash
# routed_experts' arguments after (x, weights, ids), with out_bf16's default
_EXPERT_ARGS = ("w1", "w3", "w2", "limit", "quantize_x", "quantize_h", "shared_expert", "out_bf16")


def _routing(node: torch.fx.Node) -> tuple[torch.fx.Node, dict] | None:
    """The fused_router call whose (weights, ids) outputs are routed_experts `node`'s, with the router's
    getitems by index, or None."""
    weights, ids = node.args[1], node.args[2]
    items = {}
    for index, item in ((0, weights), (1, ids)):
        if item.op != "call_function" or item.target is not operator.getitem or item.args[1] != index:
            return None
        items[index] = item
    router = weights.args[0]
    if (router is not ids.args[0] or router.target is not ops.fused_router.default or len(router.args) != 6
            or router.args[0] is not node.args[0] or set(router.users) != set(items.values())):
        return None
    return router, items


class RouterExpertsFusionPass:
    name = "router_experts_fusion"

    def __init__(self):
        self.options = {}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Rewrite every match in `graph`; returns how many were replaced."""
        fused = 0
        for node in list(graph.find_nodes(op="call_function", target=ops.routed_experts.default)):
            fused += self._fuse(graph, node)
        return fused

    def _fuse(self, graph: torch.fx.Graph, node: torch.fx.Node) -> int:
        found = _routing(node)
        if found is None:
            return 0
        router, items = found
        experts = {"out_bf16": False, **dict(zip(("x", "weights", "ids", *_EXPERT_ARGS), node.args)), **node.kwargs}
        if experts["shared_expert"] < 0:
            return 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        others = [user for item in items.values() for user in item.users if user is not node]
        if any(order[user] < order[node] for user in others):
            return 0
        with graph.inserting_before(node):
            y, weights, ids = insert_call(graph, ops.routed_moe.default,
                                          (*router.args, *(experts[name] for name in _EXPERT_ARGS)), 3)
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        for index, item in items.items():
            item.replace_all_uses_with((weights, ids)[index])
            graph.erase_node(item)
        graph.erase_node(router)
        return 1
