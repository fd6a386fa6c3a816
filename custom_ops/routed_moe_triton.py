"""Triton launches of `dsflash::routed_moe` (see routed_moe.py for the math): the router and the routed experts
in three launches, the shared expert's up projection beside the router.

The shared expert does not depend on the routing, yet dsflash::routed_experts computes its h in the up kernel,
after the router's launch: at decode batch 1 that launch is a latency chain (GEMV partials, two counters, the
top-k) of a few programs while the GPU's bandwidth idles (flash-40l-e8, H200: 7.1 us a layer on the step's path).
Here the first launch's grid is the router's programs, then the shared expert's h: SHARED_SPLITS programs per
column block, each over a share of D, the last one adding the partial sums (every token at the shared slot with
weight 1, rounded as the up kernel rounds; one split gives the up kernel's bits, more move the GEMMs' fp32
summation order). The second launch is the up kernel for the routed pairs only (SKIP_SHARED), the third the
down kernel with the ordered per-token sum, unchanged. The router's programs come first in the grid, so they
are scheduled first; the two roles share no data, so no program waits for the other's.
"""

import torch
import triton
import triton.language as tl

from . import router_triton, routed_experts_triton
from .pdl import launch_options, pdl_wait
from .router_triton import _router_program
from .routed_experts_triton import _gate_up, _store_h


@triton.jit
def _router_shared_up_kernel(x_ptr, gate_ptr, bias_ptr, partial_ptr, scores_ptr, counter_ptr, weights_ptr, ids_ptr,
                             N, D, E, k_blocks_per_split, scale, token_blocks, expert_blocks, splits,
                             w1_ptr, w3_ptr, h_ptr, sums_ptr, KK, SLOTS, shared, I, limit,
                             TOPK: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                             SPLITS_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                             ROUTER_BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr, X_FP32: tl.constexpr,
                             QUANT_X: tl.constexpr, QUANT_H: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHARED_SPLITS: tl.constexpr,
                             FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, token_blocks x expert_blocks x splits): the router's, in its grid's order; then SHARED_SPLITS
    programs per column block of the shared expert's h, each over a share of D (one program alone streams too
    slowly: H200, flash-40l-e8 B1, one program a column block took 28 us of the step's path against the router's
    7); the last of a block to finish adds their partial sums in order (fixed: deterministic) and stores h. The
    block's counter comes after the router's in counter_ptr."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    pid = tl.program_id(0)
    router_programs = token_blocks * expert_blocks * splits
    if pid < router_programs:
        _router_program(pid // (expert_blocks * splits), (pid // splits) % expert_blocks, pid % splits, token_blocks,
                        expert_blocks, splits, x_ptr, gate_ptr, bias_ptr, partial_ptr, scores_ptr, counter_ptr,
                        weights_ptr, ids_ptr, N, D, E, k_blocks_per_split, scale, TOPK, K_PAD, E_PAD, SPLITS_PAD,
                        BLOCK_T, BLOCK_E, ROUTER_BLOCK_K, NORMALIZE, X_FP32, FP32_DOT)
    else:
        block = (pid - router_programs) // SHARED_SPLITS
        part = (pid - router_programs) % SHARED_SPLITS
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.arange(0, BLOCK_M)
        routed = t < N  # every token, at the shared slot KK with weight 1 (ids and weights: the router's to write)
        k_blocks = tl.cdiv(D, BLOCK_K)
        per_part = tl.cdiv(k_blocks, SHARED_SPLITS)
        first = part * per_part
        gate, up = _gate_up(x_ptr, w1_ptr, w3_ptr, shared, routed, n, first,
                            tl.maximum(tl.minimum(per_part, k_blocks - first), 0), I, D, QUANT_X, BLOCK_M, BLOCK_N,
                            BLOCK_K, FP32_DOT)
        tile = t[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        sums = sums_ptr + block * (SHARED_SPLITS * 2 * BLOCK_M * BLOCK_N)
        tl.store(sums + (2 * part) * BLOCK_M * BLOCK_N + tile, gate)
        tl.store(sums + (2 * part + 1) * BLOCK_M * BLOCK_N + tile, up)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        counter = counter_ptr + (expert_blocks + 1) * token_blocks + block
        if tl.atomic_add(counter, 1, sem="acq_rel") == SHARED_SPLITS - 1:
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for p in tl.static_range(SHARED_SPLITS):  # .cg: bypass L1 (not coherent across SMs)
                gate += tl.load(sums + (2 * p) * BLOCK_M * BLOCK_N + tile, cache_modifier=".cg")
                up += tl.load(sums + (2 * p + 1) * BLOCK_M * BLOCK_N + tile, cache_modifier=".cg")
            _store_h(h_ptr, gate, up, tl.where(routed, 1.0, 0.0), limit, routed, KK, n, SLOTS, I, QUANT_H, BLOCK_M)
            tl.atomic_xchg(counter, 0)  # zero for the next launch


SHARED_SPLITS = 4  # 72 column blocks at I = 2304: 288 programs, ~2 a SM of an H200 beside the router's
# One 16-row tile of tokens (decode up to CompileOptions.moe_few_tokens' default): at 32 rows the shared expert's
# tiles beside the partial sums spilled on sm_90 (255 registers, 16-64 bytes of stack), also with 64-wide K blocks
MAX_TOKENS = 16


def kernel_fits(x, gate, bias, topk, w1, w3, w2, shared_expert) -> bool:
    """What the launches take (else the op runs fused_router then routed_experts): both kernels' inputs, a shared
    expert, and at most MAX_TOKENS tokens."""
    return (shared_expert >= 0 and x.shape[0] <= MAX_TOKENS and x.dtype == torch.bfloat16
            and router_triton.kernel_fits(x, gate, bias, topk) and routed_experts_triton.kernel_fits(x, w1, w3, w2))


def routed_moe_triton(x, gate, bias, topk, normalize, scale, w1, w3, w2, limit, quantize_x, quantize_h,
                      shared_expert, out_bf16=False, shared_splits=SHARED_SPLITS):
    """(y, weights, ids) as the reference (routed_moe.py). shared_splits: programs per column block of the shared
    expert's h, each over a share of D's blocks."""
    tokens = x.shape[0]
    if tokens > MAX_TOKENS:
        raise ValueError(f"routed_moe: {tokens} tokens; the launches take at most {MAX_TOKENS} (kernel_fits)")
    weights = x.new_empty(tokens, topk, dtype=torch.float32)
    ids = x.new_empty(tokens, topk, dtype=torch.int64)
    p = routed_experts_triton.plan(x, weights, ids, w1, w3, w2, quantize_x, shared_expert, out_bf16)
    if tokens == 0:
        return p.y, weights, ids
    x, _, _, w1, w3, _ = p.tensors
    route = router_triton.plan(x, gate.contiguous(), bias.contiguous(), weights, ids, topk, normalize, scale)
    router = {("ROUTER_BLOCK_K" if name == "BLOCK_K" else name): value for name, value in route.constexprs.items()}
    _, k, slots, shared, _, inter, _ = p.sizes
    router_programs = route.grid[0] * route.grid[1] * route.grid[2]
    blocks = triton.cdiv(inter, p.up["block_n"])
    counters = route.args[5]  # the router's; the shared expert's column blocks take the ones after them
    if counters.numel() < (route.grid[1] + 1) * route.grid[0] + blocks:
        raise ValueError(f"routed_moe: {blocks} column blocks of the shared expert need more counters than the "
                         f"buffer's {counters.numel()}")
    sums = x.new_empty(blocks * shared_splits * 2 * p.fixed["BLOCK_M"] * p.up["block_n"], dtype=torch.float32)
    _router_shared_up_kernel[(router_programs + blocks * shared_splits,)](
        *route.args, *route.grid, w1, w3, p.h, sums, k, slots, shared, inter, float(limit), **router,
        QUANT_X=quantize_x, QUANT_H=quantize_h, BLOCK_M=p.fixed["BLOCK_M"], BLOCK_N=p.up["block_n"],
        BLOCK_K=p.up["block_k"], SHARED_SPLITS=shared_splits, num_warps=p.up["num_warps"],
        num_stages=p.up["num_stages"], **launch_options(x.device))
    routed_experts_triton.launch_up(p, limit, quantize_x, quantize_h, skip_shared=True)
    routed_experts_triton.launch_down(p)
    return p.y, weights, ids
