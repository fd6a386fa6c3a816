"""mHC overlap (issue 8): split each fused seam of at most `max_tokens` tokens so that its mixes run on a side
CUDA stream beside the next sublayer (custom_ops/mhc_split.py has the ops and why this is legal).

    mhc_seam(out, X, q, C, p_lag, fn, scale, base, w)      (X', normed) = mhc_seam_input(out, X, q, C, p_lag, w)
      -> (X', normed, p, q', C')                      =>    (p, q', C') = mhc_mixes(X', fn, scale, base)
                                                            ... the next sublayer, on the current stream ...
                                                            mhc_join_(p, q', C', after the sublayer)
                                                                                    before the first reader
    mhc_entry_seam(X, p_lag, fn, scale, base, w)      =>    normed = mhc_entry_input(X, p_lag, w); mhc_mixes(X, ...)

The join goes before the first node that reads the mixes' data (views of them move behind it) and also
takes the sublayer's results: without them Inductor's scheduler, seeing no input of the join produced by the
sublayer, issues the join right after the fork and nothing overlaps.

Runs after the mHC fusion pass. The token count must be static (the compiled decode and prefill graphs are):
above the cutoff a seam keeps its one launch, where the mixes would take longer than the sublayer they hide
behind (the cutoff is to be measured with scripts/bench_overlap.py). Only seams with fp32 `fn` are split:
there the fused op and the split ops both run their Triton kernels, which give the same bits. The readers of
the mixes include the next seam's ops, which also read X', so X' stays alive (and unreused by Inductor)
until after the join.
"""

import torch

from .graph_edit import call, fused_seams, move_views_before, seam_arguments, static_tokens, views_and_readers

ops = torch.ops.dsflash


class MhcOverlapPass:
    name = "mhc_overlap"

    def __init__(self, max_tokens: int):
        """Split seams of at most max_tokens tokens."""
        self.options = {"max_tokens": max_tokens}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Split every fused seam within the cutoff; returns how many were split."""
        return sum(self._split(graph, node) for node in fused_seams(graph))

    def _split(self, graph: torch.fx.Graph, node: torch.fx.Node) -> int:
        a = seam_arguments(node)
        tokens = static_tokens(a.streams)
        if tokens is None or tokens > self.options["max_tokens"] or a.fn.meta["val"].dtype != torch.float32:
            return 0
        with graph.inserting_before(node):
            if a.out is None:
                inputs = [call(graph, ops.mhc_entry_input.default,
                               (a.streams, a.pre_lagged, a.norm_weight, a.norm_eps), 0)]
                mixed = a.streams
            else:
                inputs = call(graph, ops.mhc_seam_input.default,
                              (a.out, a.streams, a.post, a.comb, a.pre_lagged, a.norm_weight, a.norm_eps), 2)
                mixed = inputs[0]
            mixes = call(graph, ops.mhc_mixes.default,
                         (mixed, a.fn, a.scale, a.base, a.norm_eps, a.hc_eps, a.iters), 3)
        for item in list(node.users):
            item.replace_all_uses_with((inputs + mixes)[item.args[1]])
            graph.erase_node(item)
        graph.erase_node(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
        views, readers = views_and_readers(mixes)
        first_reader = min(readers, key=order.__getitem__, default=mixes[-1].next)
        # the sublayer: what runs between the fork and the first reader; its results read at or after that
        # reader are the join's `after`, so Inductor keeps the join behind the sublayer
        between = [n for n in list(graph.nodes)[order[mixes[-1]] + 1:order[first_reader]] if n not in views]
        after = [n for n in between if isinstance(n.meta.get("val"), torch.Tensor)
                 and any(order[user] >= order[first_reader] for user in n.users)]
        with graph.inserting_before(first_reader):
            call(graph, ops.mhc_join_.default, (*mixes, after), 0)
        move_views_before(views, first_reader, order)  # views of the mixes move behind the join too
        return 1
