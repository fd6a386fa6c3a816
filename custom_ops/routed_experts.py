"""`dsflash::routed_experts`: the routed experts' weighted sum for a few tokens (decode), as one op.

    x = fp8_qdq(x) in groups of 32                               (quantize_x: as the experts' QuantLinears do)
    each token's pairs: its k (expert id, weight) slots, then (shared_expert, 1.0) if shared_expert >= 0
    for each expert e in ascending id, for each token t routed to e (slot s, weight w):
        gate, up = bf16(x_t @ W1[e]^T), bf16(x_t @ W3[e]^T)       (fp32 products, rounded as the GEMMs round)
        gate, up = min(gate, limit), clamp(up, -limit, limit)    (limit > 0 only)
        h = bf16(w * silu(gate) * up), then FP8 quantize-dequantized in groups of 32 (quantize_h)
        y_t += fp32(bf16(h @ W2[e]^T))
    y = bf16(y) with out_bf16 (as MoE casts it: the block's next seam takes it in bf16), else fp32

ids [tokens, k] may hold -1 (a pair another rank's experts take: it adds nothing). shared_expert is the stacks'
slice of the shared expert when MoE stacks it (stack_experts(shared=True)): the op adds its pair itself, so
no kernel pads the weights and ids first. The per-token sum runs in ascending expert id, the order of MoE's
loop and grouped paths, so only the GEMMs' fp32 summation order differs from them. The stacks are the bf16
weights MoE.stack_experts() holds ([G, I, D], [G, I, D], [G, D, I]).

Why an op: MoE's grouped path sorts the (token, slot) pairs by expert, runs one grouped GEMM per projection
and gathers the outputs back: at decode batch 1 that is ~15 small kernels around the three GEMMs per layer
(H200, flash-40l-e8: ~20 us of launches and gaps per layer). On CUDA this op is two launches that need
no sorting, quantize x in the first and sum each token's terms in the second (routed_experts_triton.py). The
reference below runs every expert over every token (static shapes, no host sync), for CPU and for inputs the
kernels do not take.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from dsflash_compile.quant import fp8_qdq

MAX_TOKENS = 64  # the kernels' tile of token rows (more would spill registers on sm_90); above, the reference


@torch.library.custom_op("dsflash::routed_experts", mutates_args=())
def routed_experts(x: Tensor, weights: Tensor, ids: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, limit: float,
                   quantize_x: bool, quantize_h: bool, shared_expert: int, out_bf16: bool = False) -> Tensor:
    """x bf16 [T, D]; weights fp32 [T, k]; ids int64 [T, k] (-1: not here); w1, w3 bf16 [G, I, D]; w2 bf16
    [G, D, I]; shared_expert: a slice of the stacks every token takes with weight 1 (-1: none). Returns fp32
    [T, D] (bf16 with out_bf16: rounded once): each token's experts' weighted SwiGLU outputs, summed in
    ascending id."""
    return routed_experts_reference(x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared_expert,
                                    out_bf16)


def check_inputs(x, weights, ids, w1, w3, w2, quantize_x, quantize_h, shared_expert) -> None:
    if x.dim() != 2 or weights.dim() != 2 or tuple(ids.shape) != tuple(weights.shape) or ids.shape[0] != x.shape[0]:
        raise ValueError(f"routed_experts: x [T, D], weights and ids [T, k] expected, got {tuple(x.shape)}, "
                         f"{tuple(weights.shape)} and {tuple(ids.shape)}")
    if ids.dtype != torch.int64 or weights.dtype != torch.float32:
        raise TypeError(f"routed_experts: ids must be int64 and weights fp32, got {ids.dtype} and {weights.dtype}")
    if w1.dim() != 3 or w1.shape != w3.shape or tuple(w2.shape) != (w1.shape[0], w1.shape[2], w1.shape[1]):
        raise ValueError(f"routed_experts: w1, w3 [G, I, D] and w2 [G, D, I] expected, got {tuple(w1.shape)}, "
                         f"{tuple(w3.shape)} and {tuple(w2.shape)}")
    if w1.shape[2] != x.shape[1]:
        raise ValueError(f"routed_experts: x {tuple(x.shape)} and w1 {tuple(w1.shape)} differ in D")
    if quantize_h and w1.shape[1] % 32:
        raise ValueError(f"routed_experts: quantize_h needs the intermediate size ({w1.shape[1]}) to be a multiple "
                         "of the FP8 group (32)")
    if quantize_x and x.shape[1] % 32:
        raise ValueError(f"routed_experts: quantize_x needs the hidden size ({x.shape[1]}) to be a multiple of the "
                         "FP8 group (32)")
    if not -1 <= shared_expert < w1.shape[0]:
        raise ValueError(f"routed_experts: shared_expert={shared_expert} is not a slice of the {w1.shape[0]} stacked "
                         "experts (or -1: none)")


def with_shared_expert(weights, ids, shared_expert):
    """The token's pairs with the shared expert's appended (weight 1), as the kernels see them."""
    if shared_expert < 0:
        return weights, ids
    return F.pad(weights, (0, 1), value=1.0), torch.cat([ids, torch.full_like(ids[:, :1], shared_expert)], 1)


def routed_experts_reference(x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared_expert,
                             out_bf16=False):
    check_inputs(x, weights, ids, w1, w3, w2, quantize_x, quantize_h, shared_expert)
    weights, ids = with_shared_expert(weights, ids, shared_expert)
    if quantize_x:
        x = fp8_qdq(x)
    y = x.new_zeros(x.shape, dtype=torch.float32)
    for e in range(w1.shape[0]):
        hit = ids == e
        w = (weights * hit).sum(1, keepdim=True)  # the token's weight for e (0 where not routed), exact
        gate, up = F.linear(x, w1[e]).float(), F.linear(x, w3[e]).float()
        if limit > 0:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        h = (w * (F.silu(gate) * up)).to(x.dtype)
        out = F.linear(fp8_qdq(h) if quantize_h else h, w2[e]).float()
        y = y + torch.where(hit.any(1, keepdim=True), out, 0.0)
    return y.to(torch.bfloat16) if out_bf16 else y


@routed_experts.register_fake
def _(x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared_expert, out_bf16=False):
    check_inputs(x, weights, ids, w1, w3, w2, quantize_x, quantize_h, shared_expert)
    return x.new_empty(x.shape, dtype=torch.bfloat16 if out_bf16 else torch.float32)


try:  # Triton is optional on CPU machines
    from . import routed_experts_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    routed_experts_triton = None

if routed_experts_triton is not None:
    @routed_experts.register_kernel("cuda")
    def _(x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared_expert, out_bf16=False):
        args = (x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared_expert, out_bf16)
        check_inputs(x, weights, ids, w1, w3, w2, quantize_x, quantize_h, shared_expert)
        if not routed_experts_triton.kernel_fits(x, w1, w3, w2):
            return routed_experts_reference(*args)
        return routed_experts_triton.routed_experts_triton(*args)
