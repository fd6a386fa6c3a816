"""Early reads (issue 5): a dsflash op whose kernel can read and compute before its PDL wait gets `early=True`
where that is safe, that is where a kernel computed from every producer of the op's inputs runs between them and
the op (pdl.py: a kernel is scheduled once the kernel just before it has passed its own wait, so everything before
that one has finished).

For such an op the pass picks the anchor, the latest node before the op's first reader that is computed from all
of its inputs' producers (seen through views) and not from the op, moves the op right after it and passes the
anchor's output as the op's `after` (never read): Inductor then issues the op after the anchor's kernel. An op
whose inputs all come from outside the graph, or with no such anchor, is left as it is.

Ops (each kind an option): dsflash::kv_norm_rope (kv_rows), the attention's key/value row from the wq_a + wkv
projection, which in the decode step runs after the query's norm, wq_b and RoPE: its kernel then only waits to store
(its path ~1.5 us a layer at B1 on the H200, 12-03 x). dsflash::bf16_gemv and dsflash::fp32_gemv (gemv), one-row
projections: their anchor is the latest projection before them (a kernel streaming a weight, long enough to hide
them) computed from their input that no other early projection follows, and they only move up to it, never later
(they may be on the step's path): the indexer's wq_b after the attention's wq_b (12-04 d5 trace: 7.6 us of an
index layer's path after it), its weights_proj and the compressors' projections after wq_a + wkv.
"""

import torch

from .graph_edit import descendants, mutated, source, starts_early

ops = torch.ops.dsflash
KV_ROW_OPS = (ops.kv_norm_rope.default,)
GEMV_OPS = (ops.bf16_gemv.default, ops.fp32_gemv.default)
STREAMING_OPS = (ops.bf16_gemv.default, ops.bf16_linear.default, ops.fp32_gemv.default)  # a GEMV's anchors


class EarlyReadsPass:
    name = "early_reads"

    def __init__(self, kv_rows: bool = True, gemv: bool = False):
        """kv_rows: kv_norm_rope reads early; gemv: one-row projections do (module notes)."""
        self.options = {"kv_rows": kv_rows, "gemv": gemv}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Make every op of the chosen kinds with an anchor read early; returns how many."""
        targets = (KV_ROW_OPS if self.options["kv_rows"] else ()) + (GEMV_OPS if self.options["gemv"] else ())
        return sum(self._early(graph, node) for node in list(graph.nodes)
                   if node.target in targets and not node.kwargs.get("early", False))

    def _early(self, graph: torch.fx.Graph, node: torch.fx.Node) -> int:
        inputs = node.all_input_nodes
        producers = {source(n) for n in inputs} - {n for n in graph.nodes if n.op in ("placeholder", "get_attr")}
        if not producers or node.users == {}:
            return 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_reader = min(node.users, key=order.__getitem__)
        computed = set.intersection(*(descendants(p) for p in producers)) - descendants(node) - {node}
        anchors = [n for n in computed if n.op == "call_function" and order[n] < order[first_reader]
                   and isinstance(n.meta.get("val"), torch.Tensor) and source(n) is n and not starts_early(n)
                   and all(order[i] < order[n] for i in inputs)]
        if node.target in GEMV_OPS:
            hosts = {user.kwargs.get("after") for user in graph.nodes if user.target in GEMV_OPS and starts_early(user)}
            anchors = [n for n in anchors if n.target in STREAMING_OPS and order[n] < order[node] and n not in hosts]
        if not anchors:
            return 0
        anchor = max(anchors, key=order.__getitem__)
        # the op moves past the nodes between its place and its anchor's: none may write what it reads
        low, high = sorted((order[node], order[anchor]))
        sources = {source(n) for n in inputs}
        if any(source(m) in sources for n in list(graph.nodes)[low + 1:high + 1] for m in mutated(n)):
            return 0
        anchor.append(node)
        node.kwargs = {**node.kwargs, "after": anchor, "early": True}
        return 1
