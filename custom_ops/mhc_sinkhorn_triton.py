"""The mHC comb's Sinkhorn rounds (dsflash_compile/mhc.py `sinkhorn`) on a register tile, shared by the seam
kernels: one token's [hc, hc] (mhc_triton.py) or a block of tokens' [tokens, hc, hc] (mhc_rows_triton.py)."""

import triton
import triton.language as tl


@triton.jit
def _sinkhorn(logits, hc_eps, iters):
    """[..., hc, hc] logits (row a = input stream) -> doubly stochastic comb, the reference's expressions and
    order: softmax over b + eps, columns, then (iters - 1) rounds of rows then columns, all fp32."""
    comb = tl.exp(logits - tl.max(logits, axis=-1, keep_dims=True))
    comb = comb / tl.sum(comb, axis=-1, keep_dims=True) + hc_eps
    comb = comb / (tl.sum(comb, axis=-2, keep_dims=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=-1, keep_dims=True) + hc_eps)
        comb = comb / (tl.sum(comb, axis=-2, keep_dims=True) + hc_eps)
    return comb
