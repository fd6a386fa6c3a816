"""`dsflash::expert_order`: the orders MoE's grouped path needs from the routed ids, as one op.

    ids [T, k] (expert per (token, slot) pair, -1: a pair another rank's experts take), groups G
    key       = ids.flatten() with -1 read as G                  (such pairs sort after every expert's)
    order     = key.argsort(stable=True)                         (the pairs sorted by expert)
    rank      = order's inverse                                  (pair p lands at rank[p])
    offsets   = cumsum of the pairs per expert 0..G-1 (int32)    (the grouped GEMMs' row offsets)
    ascending = ids.argsort(dim=1, stable=True)                  (each token's slots by ascending id)

Why an op: MoE computes these by counting (MoE._expert_order, _slot_order; no argsort, whose Inductor
lowering is one single-program sort), which Inductor turned into ~12 small kernels per layer (cumsums, gathers,
scatters, aranges; H200, flash-40l-e8 bf16 decode B64, 12-02 o/p traces: ~15 us of kernels and ~5 us of launch
gaps a layer). On CUDA one program computes all four (expert_order_triton.py) where the pairs' one-hot
[G + 1, pairs] fits a program (`kernel_fits`); MoE calls the op only there. The reference is the definition
above (argsort), which MoE's counting orders are tested against.
"""

import torch
from torch import Tensor

# the kernel holds the pairs' one-hot in one program: (G + 1, padded to a power of 2) x (pairs, padded) values
MAX_ONEHOT = 16384


@torch.library.custom_op("dsflash::expert_order", mutates_args=())
def expert_order(ids: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """ids int64 [T, k] in -1..groups-1. Returns (order int64 [T k], rank int64 [T k], offsets int32 [groups],
    ascending int64 [T, k])."""
    return expert_order_reference(ids, groups)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def kernel_fits(pairs: int, groups: int) -> bool:
    """Whether the kernel takes `pairs` pairs over `groups` experts (shapes only)."""
    return 0 < pairs and _pow2(groups + 1) * _pow2(pairs) <= MAX_ONEHOT


def check_inputs(ids: Tensor, groups: int) -> None:
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(f"expert_order: ids must be int64 [tokens, k], got {ids.dtype} {tuple(ids.shape)}")
    if groups < 1:
        raise ValueError(f"expert_order: groups={groups}; expected at least 1")


def expert_order_reference(ids: Tensor, groups: int):
    check_inputs(ids, groups)
    expert = ids.flatten()
    order = torch.where(expert >= 0, expert, groups).argsort(stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=ids.device))
    # pairs per expert by comparison: no host sync (bincount of the masked ids would need one), graph-safe where
    # the CUDA kernel does not fit and this runs instead
    counts = (expert.unsqueeze(1) == torch.arange(groups, device=ids.device)).sum(0)
    return order, rank, counts.cumsum(0).to(torch.int32), ids.argsort(dim=1, stable=True)


@expert_order.register_fake
def _(ids, groups):
    check_inputs(ids, groups)
    pairs = ids.numel()
    return (ids.new_empty(pairs), ids.new_empty(pairs), ids.new_empty(groups, dtype=torch.int32),
            ids.new_empty(ids.shape))


try:  # Triton is optional on CPU machines
    from . import expert_order_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    expert_order_triton = None

if expert_order_triton is not None:
    @expert_order.register_kernel("cuda")
    def _(ids, groups):
        check_inputs(ids, groups)
        if not kernel_fits(ids.numel(), groups):
            return expert_order_reference(ids, groups)
        return expert_order_triton.expert_order_triton(ids, groups)
