"""The MoE's router inside the FFN's seam (issue 5): a router whose input is the normed output of a seam that
leaves its mixes as partials becomes one op with that seam (custom_ops/mhc_deferred.py has it and why):

    (X', normed, partials) = mhc_seam_partials(out, X, q, C, p_lag, fn, w, eps)
    (weights, ids) = fused_router(view(normed), gate, bias, k, normalize, scale)
        =>  (X', normed, partials, weights, ids) = mhc_seam_partials_routed(out, ..., eps, gate, bias, k, ...)

Runs after the router fusion and the deferral passes; gates of at most `max_experts` experts (the seam's one
finishing program holds the gate's tiles; the release's 384 keep the router's own grid).
"""

import operator

import torch

from .graph_edit import call, is_view

ops = torch.ops.dsflash


class RouterSeamPass:
    name = "router_seam"

    def __init__(self, max_experts: int):
        self.options = {"max_experts": max_experts}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Fold every router that reads a deferred seam's normed rows (through views) into that seam; returns
        how many were folded."""
        return sum(self._fold(graph, router) for router in
                   list(graph.find_nodes(op="call_function", target=ops.fused_router.default)))

    def _fold(self, graph: torch.fx.Graph, router: torch.fx.Node) -> int:
        x, gate, bias, topk, normalize, scale = router.args
        while is_view(x):
            x = x.args[0]
        seam = x.args[0] if x.op == "call_function" and x.target is operator.getitem else None
        if (seam is None or seam.target is not ops.mhc_seam_partials.default or x.args[1] != 1
                or gate.meta["val"].shape[0] > self.options["max_experts"]):
            return 0
        with graph.inserting_before(seam):
            items = call(graph, ops.mhc_seam_partials_routed.default, (*seam.args, gate, bias, topk, normalize, scale),
                         5)
        for old, outputs in ((seam, items[:3]), (router, items[3:])):
            for item in list(old.users):
                item.replace_all_uses_with(outputs[item.args[1]])
                graph.erase_node(item)
            graph.erase_node(old)
        return 1
