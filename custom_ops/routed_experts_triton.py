"""Triton kernels of `dsflash::routed_experts` (see routed_experts.py for the math): two launches, no sort.

A token's pairs are its k stored (id, weight) slots and, with a shared expert, one more slot (that id, weight
1) that no tensor holds: _slot_ids makes it up.

_up_kernel, grid (pairs, I / BLOCK_N): the program of pair p takes p's expert e if p is e's first pair (in
token-major order; later pairs of e exit after reading the ids); above BY_EXPERT_ABOVE tokens the grid's rows
are the stacked experts instead, row r taking the r-th smallest id the pairs hold (by_expert_grid: far fewer
idle programs at 64 tokens). Either way one program computes, for every token routed to e at
once (rows of a BLOCK_M tile, the others masked), its BLOCK_N columns of gate and up, the clamps, SwiGLU, the
routing weight and the FP8 quantize-dequantize of h (a 32-column group lies inside a block), storing h at the
token's slot. Each picked expert's W1 and W3 are read once, over many programs. With QUANT_X each program
quantize-dequantizes the x tiles it loads (BLOCK_K holds whole groups of 32): the same values as a separate
FP8 kernel before the op, one launch fewer.

_down_kernel, grid (pairs or experts, D / BLOCK_N): the same split for W2, storing each pair's bf16 output row;
then each program bumps its column block's counter (block_counters.py, lane "main": the MoE runs between the router and
the seam on their stream), and the block's last one adds every token's pair outputs there in ascending expert
id (the next one is the smallest id above the last), the order of MoE's paths, with no atomics on the sum: the
result is deterministic. Until 12-02 (session o) a third launch did that sum (3.8 us and a ~0.4 us gap per
layer at batch 1 on the H200). (A down kernel that walked the experts in order itself, one program per column
block, left too few programs in flight: 74 us per layer at batch 1, against 42 for the grouped GEMM, 12-01.)

The FP8 rounding is fp8_qdq_triton._fp8_qdq_groups (fp32 arithmetic the interpreter runs as the GPU does).
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot
from .bf16_bits import _round_bf16
from .block_counters import block_counters
from .fp8_qdq_triton import _fp8_qdq_groups
from .pdl import launch_options, pdl_release, pdl_wait, pdl_wait_only
from .routed_experts import MAX_TOKENS

UP_BLOCK_N = 32  # one FP8 group of h per row and program; 72 column blocks at I = 2304
DOWN_BLOCK_N = 32  # 160 column blocks at D = 5120
# registers a thread (ptxas's .maxnreg; None: as many as the compiler takes). As launched at batch 1 (sizes
# specialized as multiples of 16: cp.async, 3 stages) the up kernel takes 92 registers and 44 KB of shared memory,
# 5 programs an SM; at 128 the compiler takes all 128 (4 an SM). H200, B1 side by side, no gain alone (12-04 c2:
# 10.299 ms against 10.376, but the up kernel 81.0 us of a layer's path against 81.2; c3: 10.616 against 10.624;
# the op alone 126.3 against 126.2 us)
UP_MAXNREG = None
BLOCK_K = 128  # 64 above 32 tokens (the down kernel: above 16): larger tiles spill at 128 (ptxas, sm_90)
# Above this many tokens the programs' rows are the stacked experts (by_expert_grid). Not timed yet: MoE runs
# this op up to CompileOptions.moe_few_tokens tokens (16 by default), so only a raised cutoff takes it
BY_EXPERT_ABOVE = 16
BY_EXPERT_MAX_COMPARES = 16384  # pairs x stacked experts (powers of two): flash-40l-e8 at 64 tokens, 512 x 16
# The up kernel's shared expert before its PDL wait (SHARED_FIRST), overlapping the router before it; the kernel
# then launches early (pdl.launch_options), placed beside the router's programs. Safe only where x was written at
# least two launches before the op (the router's launch between: MoE's few-token path). H200, B1 side by side:
# 10.531 ms against 10.321 (12-04 c1: the up kernel 86.1 us of the path against 81.2); with UP_MAXNREG 128 10.326
# against 10.319 (c5: up 80.2 against 81.4, router 4.7 against 4.4, down 45.9 against 44.3, its programs scheduled
# only once the shared ones passed their wait: the shared program now releases the down kernel at its top, not
# measured yet). Why 128 registers helps the early launch is not understood
SHARED_FIRST = False


@triton.jit
def _swiglu_h(gate, up, weight, limit, QUANT_H: tl.constexpr):
    """The fp32 GEMM accumulators gate, up [M, N] and each row's routing weight [M] -> h (fp32 holding bf16
    values): rounded as the GEMMs' bf16 outputs, clamped (limit > 0), SwiGLU times the weight rounded to bf16,
    then FP8 quantize-dequantized in groups of 32 columns (QUANT_H)."""
    gate = _round_bf16(gate)
    up = _round_bf16(up)
    if limit > 0:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    h = _round_bf16(weight[:, None] * (gate / (1.0 + tl.exp(-gate)) * up))
    if QUANT_H:
        h = _fp8_qdq_groups(h, h.shape[0], h.shape[1])  # E4M3 values times a power of two: exact in bf16
    return h


@triton.jit
def _slot_ids(ids_ptr, t, s, T, KK, shared):
    """Expert ids of (token t, slot s) (broadcast tensors or scalars): the stored ids in slots < KK, the shared
    expert (`shared`; -1: none) in slot KK, -1 beyond them and for tokens past T."""
    stored = tl.load(ids_ptr + t * KK + s, mask=(t < T) & (s < KK), other=-1)
    return tl.where((s == KK) & (t < T), shared, stored)


@triton.jit
def _program_expert(ids_ptr, prog, T, KK, SLOTS, shared, G, BLOCK_M: tl.constexpr, KK_PAD: tl.constexpr,
                 P_PAD: tl.constexpr, G_PAD: tl.constexpr, BY_EXPERT: tl.constexpr):
    """Program row `prog`'s expert e; whether it computes e (for all of e's tokens at once); the tile's [token,
    slot] hits of e; per token row, whether it is routed to e and its slot. By pair (grid rows: the pairs): e is
    pair prog's expert, computed if prog is e's first pair in token-major order (later pairs of e do nothing). By
    expert (grid rows: the G stacked experts): e is the prog-th smallest id the pairs hold, none past the last."""
    pp = tl.arange(0, P_PAD)
    pair_ids = _slot_ids(ids_ptr, pp // SLOTS, pp % SLOTS, T, KK, shared)
    if BY_EXPERT:
        g = tl.arange(0, G_PAD)
        present = tl.max((pair_ids[None, :] == g[:, None]).to(tl.int32), 1)  # [G_PAD]
        rank = tl.cumsum(present, 0)
        picked = (present > 0) & (rank == prog + 1)
        e = tl.where(tl.max(picked.to(tl.int32), 0) > 0, tl.sum(tl.where(picked, g, 0), 0), -1)
        mine = e >= 0
    else:
        e = _slot_ids(ids_ptr, prog // SLOTS, prog % SLOTS, T, KK, shared)
        earlier = tl.sum(((pair_ids == e) & (pp < prog)).to(tl.int32), 0)
        mine = (e >= 0) & (earlier == 0)
    t = tl.arange(0, BLOCK_M)
    s = tl.arange(0, KK_PAD)
    hit = _slot_ids(ids_ptr, t[:, None], s[None, :], T, KK, shared) == e  # (-1 past the slots: never e >= 0)
    routed = tl.max(hit.to(tl.int32), 1) > 0
    return e, mine, hit, routed, tl.sum(tl.where(hit, s[None, :], 0), 1)


@triton.jit
def _shared_program(ids_ptr, T, KK, shared, BLOCK_M: tl.constexpr, KK_PAD: tl.constexpr):
    """_program_expert's and the routing weight's values for program row KK (token 0's shared pair, which
    computes the shared expert for every token) without reading ids or weights (the router's outputs)."""
    t = tl.arange(0, BLOCK_M)
    s = tl.arange(0, KK_PAD)
    routed = t < T
    hit = routed[:, None] & (s == KK)[None, :]
    slot = tl.sum(tl.where(hit, s[None, :], 0), 1)
    e = shared.to(ids_ptr.dtype.element_ty)  # as _slot_ids gives it
    return e, e >= 0, hit, routed, slot, tl.where(routed, 1.0, 0.0)


@triton.jit
def _routed_program(weights_ptr, ids_ptr, prog, T, KK, SLOTS, shared, G, BLOCK_M: tl.constexpr, KK_PAD: tl.constexpr,
                    P_PAD: tl.constexpr, G_PAD: tl.constexpr, BY_EXPERT: tl.constexpr):
    """_program_expert's values and each token row's routing weight (the shared slot's: 1)."""
    e, mine, hit, routed, slot = _program_expert(ids_ptr, prog, T, KK, SLOTS, shared, G, BLOCK_M, KK_PAD, P_PAD,
                                                 G_PAD, BY_EXPERT)
    t = tl.arange(0, BLOCK_M)
    s = tl.arange(0, KK_PAD)
    stored = tl.load(weights_ptr + t[:, None] * KK + s[None, :], mask=(t < T)[:, None] & (s < KK)[None, :], other=0.0)
    return e, mine, hit, routed, slot, tl.sum(tl.where(hit, tl.where((s == KK)[None, :], 1.0, stored), 0.0), 1)


@triton.jit
def _up_kernel(x_ptr, weights_ptr, ids_ptr, w1_ptr, w3_ptr, h_ptr, T, KK, SLOTS, shared, G, I, D, limit,
               QUANT_X: tl.constexpr, QUANT_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, KK_PAD: tl.constexpr, P_PAD: tl.constexpr, G_PAD: tl.constexpr,
               BY_EXPERT: tl.constexpr, SHARED_FIRST: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    """h of each (token, slot) pair (module notes). SHARED_FIRST (by pair, a shared expert): program row KK
    streams the shared expert's weights before its PDL wait, while the router (the kernel before) still runs,
    and stores after it; x must then come from a kernel at least two launches back (pdl.py)."""
    prog, pid_n = tl.program_id(0), tl.program_id(1)
    if SHARED_FIRST:
        if prog == KK:
            pdl_release(PDL)  # the down kernel may be scheduled once the routed programs passed their wait
            e, mine, hit, routed, slot, weight = _shared_program(ids_ptr, T, KK, shared, BLOCK_M, KK_PAD)
        else:
            pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
            e, mine, hit, routed, slot, weight = _routed_program(weights_ptr, ids_ptr, prog, T, KK, SLOTS, shared, G,
                                                                 BLOCK_M, KK_PAD, P_PAD, G_PAD, BY_EXPERT)
    else:
        pdl_wait(PDL)
        e, mine, hit, routed, slot, weight = _routed_program(weights_ptr, ids_ptr, prog, T, KK, SLOTS, shared, G,
                                                             BLOCK_M, KK_PAD, P_PAD, G_PAD, BY_EXPERT)
    t = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n < I
    rows = (tl.maximum(e, 0).to(tl.int64) * I + n[:, None]) * D
    x_rows = x_ptr + t[:, None].to(tl.int64) * D
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(tl.where(mine, tl.cdiv(D, BLOCK_K), 0)):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=routed[:, None] & (k < D)[None, :], other=0.0)
        if QUANT_X:  # E4M3 values times a power of two: exact in bf16
            x = _fp8_qdq_groups(x.to(tl.float32), BLOCK_M, BLOCK_K).to(tl.bfloat16)
        w_mask = n_in[:, None] & (k < D)[None, :]
        gate += _dot(x, tl.trans(tl.load(w1_ptr + rows + k[None, :], mask=w_mask, other=0.0)), FP32_DOT)
        up += _dot(x, tl.trans(tl.load(w3_ptr + rows + k[None, :], mask=w_mask, other=0.0)), FP32_DOT)
    h = _swiglu_h(gate, up, weight, limit, QUANT_H)
    if SHARED_FIRST:
        if prog == KK:
            pdl_wait_only(PDL)  # h's rows may still be read by an earlier kernel (its buffer reused)
    out = h_ptr + (t * SLOTS + slot).to(tl.int64)[:, None] * I + n[None, :]
    tl.store(out, h.to(tl.bfloat16), mask=(mine & routed)[:, None] & n_in[None, :])


@triton.jit
def _down_kernel(h_ptr, ids_ptr, w2_ptr, out_ptr, y_ptr, counter_ptr, T, KK, SLOTS, shared, G, I, D,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KK_PAD: tl.constexpr,
                 P_PAD: tl.constexpr, G_PAD: tl.constexpr, BY_EXPERT: tl.constexpr, FP32_DOT: tl.constexpr,
                 PDL: tl.constexpr):
    """out[t, slot] = bf16(h[t, slot] @ W2[e]^T) for the tokens routed to e, over the programs that compute e
    (_program_expert); then the last program of each column block adds every token's pair outputs there into y
    (_ordered_sum)."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    prog, pid_n = tl.program_id(0), tl.program_id(1)
    e, mine, _, routed, slot = _program_expert(ids_ptr, prog, T, KK, SLOTS, shared, G, BLOCK_M, KK_PAD, P_PAD, G_PAD,
                                            BY_EXPERT)
    t = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n < D
    rows = (t * SLOTS + slot).to(tl.int64)[:, None]
    w_rows = w2_ptr + (tl.maximum(e, 0).to(tl.int64) * D + n[:, None]) * I
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(tl.where(mine, tl.cdiv(I, BLOCK_K), 0)):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        h = tl.load(h_ptr + rows * I + k[None, :], mask=routed[:, None] & (k < I)[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_in[:, None] & (k < I)[None, :], other=0.0)
        acc += _dot(h, tl.trans(w), FP32_DOT)
    tl.store(out_ptr + rows * D + n[None, :], _round_bf16(acc).to(tl.bfloat16),
             mask=(mine & routed)[:, None] & n_in[None, :])
    tl.debug_barrier()  # every thread's stores are issued before the release below
    if tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        _ordered_sum(out_ptr, ids_ptr, y_ptr, n, T, KK, SLOTS, shared, G, D, BLOCK_M, BLOCK_N, KK_PAD)
        tl.atomic_xchg(counter_ptr + pid_n, 0)  # zero for the next launch


@triton.jit
def _ordered_sum(out_ptr, ids_ptr, y_ptr, n, T, KK, SLOTS, shared, G, D, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, KK_PAD: tl.constexpr):
    """y[t, n] = token t's pair outputs in fp32, added in ascending expert id (the next id: the smallest above the
    last; ids -1 are skipped), the order of MoE's paths: deterministic, no atomics on y. A bf16 y gets the sum
    rounded to nearest even (in integer arithmetic: the interpreter's cast truncates)."""
    t = tl.arange(0, BLOCK_M)
    s = tl.arange(0, KK_PAD)
    ids = _slot_ids(ids_ptr, t[:, None], s[None, :], T, KK, shared).to(tl.int32)  # -1 past the token's slots
    n_in = n < D
    y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    e = tl.min(tl.where(ids >= 0, ids, G), 1)  # [BLOCK_M]; ids < G: G means none left
    for _ in tl.static_range(KK_PAD):  # a token's distinct ids: at most its slots (unrolled: the loads may overlap)
        live = e < G
        slot = tl.sum(tl.where(ids == e[:, None], s[None, :], 0), 1)
        # .cg: bypass L1 (not coherent across SMs) to read what the other programs wrote
        term = tl.load(out_ptr + (t * SLOTS + slot).to(tl.int64)[:, None] * D + n[None, :],
                       mask=live[:, None] & n_in[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
        y = tl.where(live[:, None], y + term, y)
        e = tl.min(tl.where(ids > e[:, None], ids, G), 1)
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = _round_bf16(y)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * D + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & n_in[None, :])


def kernel_fits(x, w1, w3, w2) -> bool:
    """What the kernels take (else the op runs its reference): bf16 activations and stacks, at most MAX_TOKENS
    tokens."""
    return x.shape[0] <= MAX_TOKENS and all(t.dtype == torch.bfloat16 for t in (x, w1, w3, w2))


def launches(tokens: int, up: dict | None = None, down: dict | None = None) -> tuple[dict, dict]:
    """Each kernel's launch at this token count (block_n, block_k, num_warps, num_stages, maxnreg), with
    overrides (sweeps: scripts/sweep_routed.py); the up kernel's block_n must be a multiple of 32 (the FP8
    groups of h).
    Up to 32 tokens the down kernel runs 2 warps, 2 stages (H200 12-01: the op took 123.2 / 166.4 / 181.1 us at
    batch 1 / 8 / 16 against 130.5 / 168.8 / 189.3 with 4 warps, 3 stages; 64 columns were as fast but spill
    at 32 tokens, and at 64 tokens 2 warps spill). Above 16 tokens its K blocks are 64 wide: at 32 tokens
    the 128-wide ones spilled (sm_90) once the kernel also sums the tokens' terms (untimed: MoE takes this op
    up to CompileOptions.moe_few_tokens, 16 by default)."""
    few = tokens <= 32
    block_k = BLOCK_K if few else BLOCK_K // 2
    up_launch = {"block_n": UP_BLOCK_N, "block_k": block_k, "num_warps": 4, "num_stages": 3, "maxnreg": UP_MAXNREG,
                 **(up or {})}
    down_launch = {"block_n": DOWN_BLOCK_N, "block_k": BLOCK_K if tokens <= 16 else BLOCK_K // 2,
                   "num_warps": 2 if few else 4, "num_stages": 2 if few else 3, "maxnreg": None,
                   **(down or {})}
    return up_launch, down_launch


def _compile_options(launch: dict) -> dict:
    """A launch's Triton compile options (maxnreg only where set)."""
    return {key: launch[key] for key in ("num_warps", "num_stages", "maxnreg") if launch.get(key) is not None}


def by_expert_grid(tokens: int, experts: int, slots: int) -> bool:
    """Whether the kernels' program rows are the stacked experts rather than the (token, slot) pairs: above
    BY_EXPERT_ABOVE tokens, where each program row also compares the pairs' ids with every expert
    (BY_EXPERT_MAX_COMPARES at most). By pair, at 64 tokens only ~650 of the up kernel's 448 x 72 programs
    (flash-40l-e8) compute."""
    pairs, stacked = triton.next_power_of_2(tokens * slots), triton.next_power_of_2(experts)
    return tokens > BY_EXPERT_ABOVE and pairs * stacked <= BY_EXPERT_MAX_COMPARES


def routed_experts_triton(x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared_expert,
                          out_bf16=False, up=None, down=None, by_expert=None, shared_first=None):
    """fp32 [T, D] (bf16 with out_bf16) as the reference. up / down override the two projections' launches (see
    `launches`); by_expert: the programs' rows (None: by_expert_grid's choice); shared_first: the up kernel's
    SHARED_FIRST where it applies (None: the module's SHARED_FIRST)."""
    tokens, dim = x.shape
    k = ids.shape[1]
    slots = k + (shared_expert >= 0)
    experts, inter, _ = w1.shape
    y = x.new_empty(tokens, dim, dtype=torch.bfloat16 if out_bf16 else torch.float32)
    if tokens * slots == 0:
        return y.zero_()
    up, down = launches(tokens, up, down)
    if up["block_n"] % 32 or (quantize_x and up["block_k"] % 32):
        raise ValueError(f"routed_experts: the up kernel's block_n ({up['block_n']}) and, with quantize_x, block_k "
                         f"({up['block_k']}) must be multiples of 32 (the FP8 groups)")
    # a pair's rows are written by its expert's programs and read only if routed (-1: never)
    h = x.new_empty(tokens, slots, inter)
    out = x.new_empty(tokens, slots, dim)
    x, weights, ids = x.contiguous(), weights.contiguous(), ids.contiguous()
    w1, w3, w2 = w1.contiguous(), w3.contiguous(), w2.contiguous()
    p_pad = triton.next_power_of_2(tokens * slots)
    g_pad = triton.next_power_of_2(experts)
    block_m = max(16, triton.next_power_of_2(tokens))
    kk_pad = triton.next_power_of_2(slots)
    by_expert = by_expert_grid(tokens, experts, slots) if by_expert is None else by_expert
    rows = experts if by_expert else tokens * slots
    fixed = dict(BLOCK_M=block_m, KK_PAD=kk_pad, P_PAD=p_pad, G_PAD=g_pad, BY_EXPERT=by_expert,
                 FP32_DOT=x.device.type != "cuda")
    shared_first = (SHARED_FIRST if shared_first is None else shared_first) and shared_expert >= 0 and not by_expert
    _up_kernel[(rows, triton.cdiv(inter, up["block_n"]))](
        x, weights, ids, w1, w3, h, tokens, k, slots, shared_expert, experts, inter, dim, float(limit),
        QUANT_X=quantize_x, QUANT_H=quantize_h, BLOCK_N=up["block_n"], BLOCK_K=up["block_k"], **fixed,
        SHARED_FIRST=shared_first, **_compile_options(up), **launch_options(x.device, early=shared_first))
    column_blocks = triton.cdiv(dim, down["block_n"])
    _down_kernel[(rows, column_blocks)](
        h, ids, w2, out, y, block_counters(x.device, column_blocks), tokens, k, slots, shared_expert, experts, inter,
        dim, BLOCK_N=down["block_n"], BLOCK_K=down["block_k"], **fixed, **_compile_options(down),
        **launch_options(x.device))
    return y
