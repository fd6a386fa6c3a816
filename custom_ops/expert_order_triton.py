"""Triton kernel of `dsflash::expert_order` (see expert_order.py for the definition): one program.

A stable sort by expert, by counting: with onehot[g, p] = (key[p] == g), pair p's rank is the pairs of smaller
keys (the exclusive cumsum of the per-key sizes at key[p]) plus the earlier pairs of its key (the inclusive
cumsum along p of its key's row, minus one), which is exactly the stable sort's; `order` is stored by
scattering p to rank[p]. Each token's slot j goes to place = its slots with a smaller id, or an equal id
before j (a [T, k, k] compare), the stable argsort along the slots. Integers only: the reference's bits.
"""

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_wait


@triton.jit
def _expert_order_kernel(ids_ptr, order_ptr, rank_ptr, offsets_ptr, ascending_ptr, T, KK, G,
                         BLOCK_P: tl.constexpr, G_PAD: tl.constexpr, T_PAD: tl.constexpr, K_PAD: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    p = tl.arange(0, BLOCK_P)
    live = p < T * KK
    expert = tl.load(ids_ptr + p, mask=live, other=-1)
    key = tl.where(live, tl.where(expert >= 0, expert, G), G_PAD)  # padding lanes match no row of the one-hot
    g = tl.arange(0, G_PAD)
    onehot = (key[None, :] == g[:, None]).to(tl.int32)  # [G_PAD, BLOCK_P]
    sizes = tl.sum(onehot, 1)
    ends = tl.cumsum(sizes, 0)
    earlier = tl.sum(tl.cumsum(onehot, 1) * onehot, 0) - 1  # the earlier pairs of the same key
    rank = tl.sum(onehot * (ends - sizes)[:, None], 0) + earlier
    tl.store(rank_ptr + p, rank.to(tl.int64), mask=live)
    tl.store(order_ptr + rank, p.to(tl.int64), mask=live)
    tl.store(offsets_ptr + g, ends, mask=g < G)

    t = tl.arange(0, T_PAD)[:, None, None]
    j = tl.arange(0, K_PAD)[None, :, None]  # the slot placed
    i = tl.arange(0, K_PAD)[None, None, :]  # the slots compared with it
    mine = tl.load(ids_ptr + t * KK + j, mask=(t < T) & (j < KK), other=0)
    other = tl.load(ids_ptr + t * KK + i, mask=(t < T) & (i < KK), other=0)
    before = ((other < mine) | ((other == mine) & (i < j))) & (i < KK)
    place = tl.sum(before.to(tl.int32), 2)  # [T_PAD, K_PAD]
    t2, j2 = tl.arange(0, T_PAD)[:, None], tl.arange(0, K_PAD)[None, :]
    slots = tl.broadcast_to(j2, (T_PAD, K_PAD)).to(tl.int64)
    tl.store(ascending_ptr + t2 * KK + place, slots, mask=(t2 < T) & (j2 < KK))


def expert_order_triton(ids: torch.Tensor, groups: int):
    """(order, rank, offsets, ascending) as the reference; the caller checks kernel_fits."""
    tokens, k = ids.shape
    pairs = tokens * k
    ids = ids.contiguous()
    order, rank = ids.new_empty(pairs), ids.new_empty(pairs)
    offsets = ids.new_empty(groups, dtype=torch.int32)
    ascending = ids.new_empty(tokens, k)
    block_p = triton.next_power_of_2(pairs)
    _expert_order_kernel[(1,)](ids, order, rank, offsets, ascending, tokens, k, groups, BLOCK_P=block_p,
                               G_PAD=triton.next_power_of_2(groups + 1), T_PAD=triton.next_power_of_2(tokens),
                               K_PAD=triton.next_power_of_2(k), num_warps=4 if block_p <= 512 else 8,
                               **launch_options(ids.device))
    return order, rank, offsets, ascending
