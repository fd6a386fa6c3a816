"""Triton kernel of `dsflash::mhc_mixes_finish` (mhc_deferred.py): a seam's mixes from its partials, one
program a token; with EARLY (the op's `early`) computed before the kernel's PDL wait.

The finishing code is the seam kernel's own (mhc_finish_triton.py: the chunks added in order, the RMS scaling,
sigmoids and Sinkhorn). Running it before the wait is right only when the partials come from a kernel at least
two launches back, which the caller guarantees with `early`: the deferral pass sets it where the op's `after`
tensors, computed from the seam's outputs, put a kernel between the two (passes/mhc_defer.py). This kernel is
scheduled once the kernel just before it has passed its own wait, so everything before that one has finished
(pdl.py). Only the stores wait: the outputs' memory may be what a running kernel still reads. The kernel lets
the next one be scheduled at its top, so that one's programs are placed as early as they were behind the
sublayer's last kernel; its wait still waits for this kernel's end. Without EARLY it waits first, as any kernel.
"""

import triton
import triton.language as tl

from .mhc_finish_triton import _mix_sums, _mixes, _store_mixes
from .pdl import launch_options, pdl_release, pdl_wait, pdl_wait_only


@triton.jit
def _mixes_finish_kernel(partial_ptr, scale_ptr, base_ptr, pre_out_ptr, post_out_ptr, comb_out_ptr, chunks,
                         norm_eps, hc_eps, iters, HC: tl.constexpr, D: tl.constexpr, PART: tl.constexpr,
                         CHUNKS_PAD: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    if EARLY:
        pdl_release(PDL)
    else:
        pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    pre_dot, post_dot, comb_dot, streams_ss = _mix_sums(row, chunks, partial_ptr, HC, PART, CHUNKS_PAD)
    pre, post, comb = _mixes(pre_dot, post_dot, comb_dot, streams_ss, scale_ptr, base_ptr, norm_eps, hc_eps, iters,
                             HC, D)
    if EARLY:
        pdl_wait_only(PDL)
    _store_mixes(row, pre, post, comb, pre_out_ptr, post_out_ptr, comb_out_ptr, HC)


def mhc_mixes_finish_triton(partials, scale, base, hc: int, dim: int, norm_eps: float, hc_eps: float, iters: int,
                            early: bool = False, num_warps: int = 4):
    """(pre [..., hc], post [..., hc], comb [..., hc, hc]) fp32 from partials [..., chunks, PART] fp32 of a seam of
    hc streams of dim values (shapes checked by the op); early: computed before the PDL wait (module docstring:
    only with a kernel between the partials' and this one). num_warps: the seam kernel's, whose finish this is."""
    *lead, chunks, part = partials.shape
    tokens = partials.numel() // (chunks * part)
    flat = partials.reshape(tokens, chunks, part).contiguous()
    pre = flat.new_empty(tokens, hc)
    post = flat.new_empty(tokens, hc)
    comb = flat.new_empty(tokens, hc, hc)
    if tokens:
        _mixes_finish_kernel[(tokens,)](flat, scale.float().contiguous(), base.float().contiguous(), pre, post, comb,
                                        chunks, norm_eps, hc_eps, iters, HC=hc, D=dim, PART=part,
                                        CHUNKS_PAD=triton.next_power_of_2(chunks), EARLY=early, num_warps=num_warps,
                                        **launch_options(flat.device))
    lead = tuple(lead)
    return pre.view(lead + (hc,)), post.view(lead + (hc,)), comb.view(lead + (hc, hc))
