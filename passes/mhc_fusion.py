"""mHC seam fusion: the graph of one seam (the previous sublayer's `hc_post`, this seam's `hc_mixes` with
its Sinkhorn, the lagged `hc_pre` and the next sublayer's RMSNorm) becomes one `dsflash::mhc_seam` call;
a seam whose streams do not come from an `hc_post` (block 0, after Engram) becomes `dsflash::mhc_entry_seam`.

The patterns are traced from the ops' references (the model's own mhc.py functions), for streams of rank 4
(the model's [B, S, hc, D]) and 3 ([N, hc, D]): the rank decides how the mixes GEMM is flattened around
its `mm`. Two rewrites make a traced pattern look like Inductor's post-grad graph:
  - Inductor turns every `view` into `reshape` before the post-grad passes run; so do we.
  - The reshapes' target sizes are the only shape-dependent arguments of a seam, and with dynamic batch
    and sequence they hold two independent symbols, which the pattern matcher's own re-trace at the real
    shapes cannot reproduce (it derives the second one from a tensor size). So those sizes match anything,
    and every other argument (reduction dims, slices, eps constants, dtypes) must match exactly: no
    re-trace is needed.
Full seams are matched first, so an entry pattern never takes the mixes of a seam that has an expansion
in front of it. Only bf16 streams (the model's) are matched, with the config's norm eps, hc eps and
Sinkhorn rounds; a seam with other eps constants is left alone.
"""

import inspect

import torch
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, fx_to_pattern, register_replacement

from dsflash_compile.custom_ops.mhc import entry_seam_reference, seam_reference


def trace_like_post_grad(fn, args, **kwargs):
    """fwd_only, then the view -> reshape rewrite Inductor applies before our pass sees the graph."""
    gm = fwd_only(fn, args, **kwargs)
    view_to_reshape(gm)
    gm.recompile()
    return gm


class _AnySize:
    """Put in place of a reshape's target size in a traced pattern; the pattern ignores this type."""


def _pattern(fn, example_inputs, argnames):
    """The pattern of `fn` with exact arguments except the reshapes' target sizes."""
    gm = trace_like_post_grad(fn, example_inputs)
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.reshape.default):
        node.args = (node.args[0], _AnySize())
    return fx_to_pattern(gm, ignore_types=(_AnySize,), argnames=argnames)


class MhcFusionPass:
    name = "mhc_fusion"

    def __init__(self, norm_eps: float, hc_eps: float, iters: int, hc: int = 4, dim: int = 8):
        """The config's constants and stream count (hc); dim only sizes the traced examples."""
        self.options = {"norm_eps": norm_eps, "hc_eps": hc_eps, "iters": iters, "hc": hc}
        self.seams = PatternMatcherPass(pass_name=self.name)
        self.entry_seams = PatternMatcherPass(pass_name=self.name + "_entry")

        def seam(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight):
            return seam_reference(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight, norm_eps,
                                  hc_eps, iters)

        def fused_seam(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight):
            return torch.ops.dsflash.mhc_seam(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight,
                                              norm_eps, hc_eps, iters)

        def entry_seam(streams, pre_lagged, fn, scale, base, norm_weight):
            return entry_seam_reference(streams, pre_lagged, fn, scale, base, norm_weight, norm_eps, hc_eps, iters)

        def fused_entry_seam(streams, pre_lagged, fn, scale, base, norm_weight):
            return torch.ops.dsflash.mhc_entry_seam(streams, pre_lagged, fn, scale, base, norm_weight, norm_eps,
                                                    hc_eps, iters)

        mix = (2 + hc) * hc
        params = [torch.empty(mix, hc * dim), torch.empty(3), torch.empty(mix), torch.empty(dim, dtype=torch.bfloat16)]
        for lead in ((2, 3), (5,)):  # rank 4 and rank 3 streams; sizes > 1 so no reshape is a no-op
            streams = torch.empty(*lead, hc, dim, dtype=torch.bfloat16)
            pre_lagged = torch.empty(*lead, hc)
            out, post, comb = torch.empty(*lead, dim, dtype=torch.bfloat16), torch.empty(*lead, hc), \
                torch.empty(*lead, hc, hc)
            for search, replace, example, patterns in (
                    (seam, fused_seam, [out, streams, post, comb, pre_lagged, *params], self.seams),
                    (entry_seam, fused_entry_seam, [streams, pre_lagged, *params], self.entry_seams)):
                pattern = _pattern(search, example, list(inspect.signature(search).parameters))
                register_replacement(search, replace, example, trace_like_post_grad, patterns,
                                     search_fn_pattern=pattern)

    def apply(self, graph: torch.fx.Graph) -> int:
        """Rewrite every seam in `graph` (full seams first); returns how many were replaced."""
        return self.seams.apply(graph) + self.entry_seams.apply(graph)
