"""Seam norm in the GEMV (issue 5): a deferred mHC seam (`dsflash::mhc_seam_partials`, passes/mhc_defer.py) whose
normed row has one reader, a `dsflash::bf16_gemv` (the attention's fused wq_a + wkv at decode batch 1), leaves the
row un-normed (the seam's `norm=False`) and the GEMV norms it (its `norm_weight`, `norm_eps`).

    (X', normed, partials) = mhc_seam_partials(out, X, q, C, p_lag, fn, w, eps);  y = bf16_gemv(view(normed), W, 1, q)
        =>  (X', collapsed, partials) = mhc_seam_partials(..., eps, False);  y = bf16_gemv(view(collapsed), W, 1, q,
                                                                                          None, 0, w, eps)

Why: with its mixes deferred the seam's path ends in one program that waits for the block's counter, reloads the
collapsed row and norms it (H200 B1 step: the attention's seam 7.3 us of the path a layer, 12-03 a3). The
whole-row GEMV's programs each load that whole row anyway (bf16_linear_gemv_triton.py's NORM), so each takes the
row's sum of squares itself and the seam runs no counter at all. Elsewhere (the GEMV's kernel holding split rows)
the op norms the row apart first: the same math. The sum of squares adds in another order than the seam's, so the
normed row may differ from it by a bf16 ulp.
"""

import torch

from .graph_edit import views_and_readers

ops = torch.ops.dsflash


class SeamNormGemvPass:
    name = "seam_norm_gemv"

    def __init__(self):
        self.options = {}

    def apply(self, graph: torch.fx.Graph) -> int:
        """Move the norm of every deferred seam read by one bf16_gemv into it; returns how many."""
        moved = 0
        for seam in list(graph.find_nodes(op="call_function", target=ops.mhc_seam_partials.default)):
            if len(seam.args) != 8:  # (norm already set)
                continue
            items = [user for user in seam.users if user.args[1] == 1]
            if len(items) != 1:
                continue
            _, readers = views_and_readers(items)
            if len(readers) != 1:
                continue
            (gemv,) = readers
            dim = seam.args[1].meta["val"].shape[-1]
            if (gemv.target is not ops.bf16_gemv.default or len(gemv.args) != 4 or gemv.args[2] != 1
                    or gemv.args[1].meta["val"].shape[-1] != dim):
                continue
            norm_weight, eps = seam.args[6], seam.args[7]
            _extend_args(seam, (False,), (False,))
            _extend_args(gemv, (None, 0, norm_weight, eps), (None, 0, norm_weight.meta["val"], eps))
            moved += 1
        return moved


def _extend_args(node: torch.fx.Node, args: tuple, vals: tuple) -> None:
    """Append args to node's; vals (their fake values) to the eager input values Inductor constrains layouts by."""
    node.args = (*node.args, *args)
    if "eager_input_vals" in node.meta:
        eager_args, eager_kwargs = node.meta["eager_input_vals"]
        node.meta["eager_input_vals"] = ((*eager_args, *vals), eager_kwargs)
