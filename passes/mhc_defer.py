"""mHC mixes deferred (issue 5): each fused seam of at most `max_tokens` tokens leaves its mixes as partials, and
a finishing op before the mixes' first reader turns them into (p, q, C) (custom_ops/mhc_deferred.py has the ops
and why this is faster):

    mhc_seam(out, X, q, C, p_lag, fn, scale, base, w) -> (X', normed, p, q', C')
        =>  (X', normed, partials) = mhc_seam_partials(out, X, q, C, p_lag, fn, w)
            ... the next sublayer ...
            (p, q', C') = mhc_mixes_finish(partials, scale, base, D, after, early=True)   before the first reader
    mhc_entry_seam(X, p_lag, fn, scale, base, w) -> (normed, p, q', C')
        =>  (normed, partials) = mhc_entry_seam_partials(X, p_lag, fn, w), and the same finish

`after`: the tensors computed from the seam's outputs before the first reader and read (or viewed and read) at
or after it: the sublayer's results. The finish kernel reads the partials before its PDL wait, which is safe
only with a kernel between the seam's and its own: so the finish takes them as inputs, and a seam with none (no
work between it and the reader, or only other finishes) stays fused. Views of the mixes move behind the finish.

Runs after the mHC fusion and overlap passes, on seams whose token count is static (the compiled decode graphs)
and whose fn is fp32 (the kernel's); at most mhc_deferred.DEFER_MAX_TOKENS tokens.
"""

import torch

from .graph_edit import (call, descendants, fused_seams, is_view, move_views_before, seam_arguments, starts_early,
                         static_tokens, views_and_readers)

ops = torch.ops.dsflash


class MhcDeferPass:
    name = "mhc_defer"

    def __init__(self, max_tokens: int):
        """Defer the mixes of seams of at most max_tokens tokens."""
        self.options = {"max_tokens": max_tokens}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Defer every fused seam within the cutoff that has a kernel between it and its mixes' first reader;
        returns how many were deferred."""
        return sum(self._defer(graph, node) for node in fused_seams(graph))

    def _defer(self, graph: torch.fx.Graph, node: torch.fx.Node) -> int:
        a = seam_arguments(node)
        entry = a.out is None
        tokens, dim = static_tokens(a.streams), a.streams.meta["val"].shape[-1]
        if (tokens is None or tokens > self.options["max_tokens"] or not isinstance(dim, int)
                or a.fn.meta["val"].dtype != torch.float32):
            return 0
        first_mix = 1 if entry else 2  # output index of pre
        mixes = [item for item in node.users if item.args[1] >= first_mix]
        order = {n: i for i, n in enumerate(graph.nodes)}
        views, readers = views_and_readers(mixes)
        if not readers:
            return 0
        first_reader = min(readers, key=order.__getitem__)
        computed = descendants(node)
        after = [n for n in list(graph.nodes)[order[node] + 1:order[first_reader]]
                 if n in computed and n.op == "call_function" and n not in views and n not in node.users
                 and isinstance(n.meta.get("val"), torch.Tensor) and not is_view(n) and not starts_early(n)
                 and any(order[reader] >= order[first_reader] for reader in views_and_readers([n])[1])]
        if not after:
            return 0
        with graph.inserting_before(node):
            if entry:
                kept = call(graph, ops.mhc_entry_seam_partials.default,
                            (a.streams, a.pre_lagged, a.fn, a.norm_weight, a.norm_eps), 2)
            else:
                kept = call(graph, ops.mhc_seam_partials.default,
                            (a.out, a.streams, a.post, a.comb, a.pre_lagged, a.fn, a.norm_weight, a.norm_eps), 3)
        partials = kept.pop()
        with graph.inserting_before(first_reader):
            finished = call(graph, ops.mhc_mixes_finish.default,
                            (partials, a.scale, a.base, dim, a.norm_eps, a.hc_eps, a.iters, after, True), 3)
        for item in list(node.users):
            item.replace_all_uses_with((kept + finished)[item.args[1]])
            graph.erase_node(item)
        graph.erase_node(node)
        move_views_before(views, first_reader, order)  # views of the mixes move behind the finish
        return 1
