"""Triton kernel of `dsflash::fused_router` (see router.py and `moe.route` for the math): one launch.

Decode is the regime that matters: 1-64 tokens against a 384 x 5120 bf16 gate (3.9 MB), a memory-bound
GEMV that needs the whole GPU to stream the gate in ~1 us. One program per (block of 16 tokens, block of
16 experts, split of D) reads a 16-expert slice of the gate once per token block; at one token that is
24 expert blocks x ~10 splits of D, about two programs per SM of an H200 (splitting the experts alone
would leave 24 programs each streaming 160 KB; at 64 tokens the 4 token blocks re-read the gate from L2).
The top-k then needs every expert's score, so two counters chain the reductions inside the same launch
(no second kernel):

  1. the last split of a (token block, expert block) to finish adds the splits' fp32 partial logits in a
     fixed order (deterministic: the same bits whichever program finishes last), applies sqrt-softplus and
     stores the block's scores;
  2. the last expert block of a token block to finish loads the block's [16, E] scores, adds the bias and
     takes the top-k by k rounds of one int64 max: the biased score's order-preserving int32 bits above
     E_PAD - 1 - expert, so one reduction picks the largest score and, among equal scores, the lowest
     expert id. torch.topk leaves the order of exact ties unspecified (on CPU it picked ids 6, 5, 4 of 8
     equal scores), so exact ties are the one place the ids may differ from the reference. The picked
     unbiased scores are gathered back from the scores just stored, then normalised and scaled.
     With at most BLOCK_E experts (flash-40l-e8's 8) step 1's program holds every score: it takes the top-k
     from its registers (picked scores selected there), without the store, the second counter and the loads.

EARLY_GATE (decode with a gate of one expert block: flash-40l-e8's 8 experts; `takes_early_gate`): a split is
one EARLY_BLOCK_K-wide tile whose gate slice the program loads before its PDL wait, while the mHC seam before it
(a chain of dependent loads, little of HBM's bandwidth) still runs; after the wait only the row comes from L2.

Each launch leaves its counters at zero (the persistent per-device buffer of block_counters.py, so a call
needs no memset and the kernel is CUDA-graph safe; scratch buffers have shapes fixed by the token count; more
than ~2600 tokens take several launches, see fused_router_triton). Only one router or mHC seam may run at a
time on a device (one stream).

Numerics: bf16 x bf16 products are exact in fp32 and accumulate in fp32 (tensor cores); fp32 activations
take an IEEE fp32 dot (not TF32). softplus is torch's: the identity above 20, else log1p(exp(x)), with
log1p(e) as log(1 + e) * e / ((1 + e) - 1) (accurate to a few ulps without libdevice, which the CPU
interpreter lacks). sqrt and the normalising division are correctly rounded, as torch's.
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot
from .block_counters import COUNTER_SLOTS, block_counters
from .pdl import launch_options, pdl_wait

BLOCK_T = 16  # tokens per program: the smallest tl.dot tile, so decode batches up to 64 get 1-4 token blocks
BLOCK_E = 16  # experts per program: the gate is split finely enough to spread one token's GEMV
BLOCK_K = 128
# Two programs per SM of an H200 (132 SMs), all resident at once (~205 registers a thread at 4 warps, most of
# them the top-k's keys, leave room for two); the D splits make up what tokens and experts do not.
TARGET_PROGRAMS = 264
MAX_EXPERTS_P2 = 512  # the top-k holds [16, E_PAD] int64 keys in registers: 64 per thread at 4 warps
# A small gate (flash-40l-e8's 8 experts: one expert block) at decode is latency-bound: 40 splits of one column
# block each (D = 5120) only lengthen the partial sums' reduction. H200 sweep (scripts/sweep_router.py, 12-02 n),
# us at 1 / 8 / 64 tokens: 8 experts 6.35 / 6.36 / 7.20 at 8 splits of 5 blocks against 6.76 / 6.98 / 7.28 at 40;
# 384 experts at 1 and 8 tokens 22.4-23.1 at 5-11 splits (22.6 / 22.7 at the 11 of before)
MIN_K_BLOCKS_PER_SPLIT = 5
# EARLY_GATE (one tile of tokens and experts: decode with a small gate): a split is one tile this wide, its gate
# slice loaded before the PDL wait, while the kernel before (the mHC seam, latency-bound) still runs. The only width
# timed (H200, 12-03 a1-a3: 10 splits of 512 at D 5120, the router's path 4.2-4.3 us a layer against 5.9)
EARLY_BLOCK_K = 512


def warps_for(x_dtype: torch.dtype) -> int:
    """fp32 activations (an fp32 model; the bf16 model feeds bf16) take 8 warps: at 4 their IEEE fp32 dot
    beside the top-k's keys spilled 312 bytes of stack on sm_90 (255 registers); 8 warps halve the keys."""
    return 8 if x_dtype == torch.float32 else 4


@triton.jit
def _sqrt_softplus(x):
    """sqrt(softplus(x)) as torch computes it (threshold 20), fp32."""
    e = tl.exp(x)
    u = 1.0 + e
    # log1p(e) = log(u) * e / (u - 1): the rounding error of u cancels in the ratio (Goldberg's trick)
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.sqrt_rn(tl.where(x > 20.0, x, log1p))


@triton.jit
def _gate_dot(acc, x, w, X_FP32: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc + x [T, K] @ w [E, K]^T in fp32."""
    if X_FP32:
        acc += tl.dot(x, tl.trans(w).to(tl.float32), input_precision="ieee")
    else:
        acc += _dot(x, tl.trans(w), FP32_DOT)
    return acc


@triton.jit
def _gate_tile(w_ptr, D, E, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """The program's [BLOCK_E, BLOCK_K] gate tile (expert block program_id(1), split program_id(2))."""
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    d = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + e[:, None].to(tl.int64) * D + d[None, :], mask=(e < E)[:, None] & (d < D)[None, :],
                   other=0.0)


@triton.jit
def _router_kernel(x_ptr, w_ptr, bias_ptr, partial_ptr, scores_ptr, counter_ptr, weights_ptr, ids_ptr,
                   N, D, E, k_blocks_per_split, scale,
                   TOPK: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr,
                   X_FP32: tl.constexpr, FP32_DOT: tl.constexpr, EARLY_GATE: tl.constexpr, PDL: tl.constexpr):
    """EARLY_GATE: a split is one BLOCK_K-wide tile, loaded before the PDL wait (the module docstring)."""
    if EARLY_GATE:  # the gate and its bias are weights, which no kernel writes: they may load before the wait
        gate_tile = _gate_tile(w_ptr, D, E, BLOCK_E, BLOCK_K)
        gate_bias = _bias(bias_ptr, tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E), E)
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    token_block = tl.program_id(0)
    expert_block = tl.program_id(1)
    split = tl.program_id(2)
    expert_blocks = tl.num_programs(1)
    splits = tl.num_programs(2)
    t = token_block * BLOCK_T + tl.arange(0, BLOCK_T)
    e = expert_block * BLOCK_E + tl.arange(0, BLOCK_E)
    t_in, e_in = t < N, e < E
    x_rows = x_ptr + t[:, None].to(tl.int64) * D
    w_rows = w_ptr + e[:, None].to(tl.int64) * D

    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    if EARLY_GATE:
        d = split * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + d[None, :], mask=t_in[:, None] & (d < D)[None, :], other=0.0)
        acc = _gate_dot(acc, x, gate_tile, X_FP32, FP32_DOT)
    else:
        for i in range(k_blocks_per_split):
            d = (split * k_blocks_per_split + i) * BLOCK_K + tl.arange(0, BLOCK_K)
            d_in = d < D
            x = tl.load(x_rows + d[None, :], mask=t_in[:, None] & d_in[None, :], other=0.0)
            w = tl.load(w_rows + d[None, :], mask=e_in[:, None] & d_in[None, :], other=0.0)
            acc = _gate_dot(acc, x, w, X_FP32, FP32_DOT)
    tile_in = t_in[:, None] & e_in[None, :]
    tl.store(partial_ptr + (t[:, None] * splits + split) * E + e[None, :], acc, mask=tile_in)

    tl.debug_barrier()  # every thread's stores are issued before the release below
    tile_counter = counter_ptr + token_block * expert_blocks + expert_block
    if tl.atomic_add(tile_counter, 1, sem="acq_rel") == splits - 1:
        s = tl.arange(0, SPLITS_PAD)
        # .cg: bypass L1 (not coherent across SMs) to read what the other programs wrote
        parts = tl.load(partial_ptr + (t[:, None, None] * splits + s[None, :, None]) * E + e[None, None, :],
                        mask=tile_in[:, None, :] & (s < splits)[None, :, None], other=0.0, cache_modifier=".cg")
        scores = _sqrt_softplus(tl.sum(parts, axis=1))
        tl.atomic_xchg(tile_counter, 0)
        if E_PAD <= BLOCK_E:  # one expert block: this tile holds every score, so the top-k starts from registers
            if EARLY_GATE:  # (else the last program's bias load is one more round trip on the router's path)
                bias = gate_bias
            else:
                bias = _bias(bias_ptr, e, E)
            _top_k(t, e, scores, bias, scores_ptr, weights_ptr, ids_ptr, N, E, scale, TOPK, K_PAD, BLOCK_E,
                   NORMALIZE, False)
        else:
            tl.store(scores_ptr + t[:, None] * E + e[None, :], scores, mask=tile_in)
            tl.debug_barrier()
            block_counter = counter_ptr + tl.num_programs(0) * expert_blocks + token_block
            if tl.atomic_add(block_counter, 1, sem="acq_rel") == expert_blocks - 1:
                ex = tl.arange(0, E_PAD)
                # .cg: the other expert blocks' scores, stored by other programs
                every = tl.load(scores_ptr + t[:, None] * E + ex[None, :], mask=(t < N)[:, None] & (ex < E)[None, :],
                                other=0.0, cache_modifier=".cg")
                _top_k(t, ex, every, _bias(bias_ptr, ex, E), scores_ptr, weights_ptr, ids_ptr, N, E, scale, TOPK,
                       K_PAD, E_PAD, NORMALIZE, True)
                tl.atomic_xchg(block_counter, 0)


@triton.jit
def _bias(bias_ptr, ex, E):
    """The routing bias of experts ex (fp32; zeros past E)."""
    return tl.load(bias_ptr + ex, mask=ex < E, other=0.0)


@triton.jit
def _top_k(t, ex, scores, bias, scores_ptr, weights_ptr, ids_ptr, N, E, scale, TOPK: tl.constexpr,
           K_PAD: tl.constexpr, W: tl.constexpr, NORMALIZE: tl.constexpr, GATHER_LOADS: tl.constexpr):
    """Tokens t: top-k experts of score + bias (ties to the lowest id), their unbiased scores normalised and
    scaled; stores weights and ids. scores [tokens, W], bias [W] (_bias): experts ex (W a power of two, ex < E the
    real ones).
    The picked scores: selected from the tile in registers, or with GATHER_LOADS loaded again from scores_ptr
    ([N, E], where the tile came from: with the release's 512-wide tile, keeping it live through the k rounds
    would spill)."""
    ex_in = ex < E
    t_in = t < N
    biased = tl.where(ex_in[None, :], scores + bias[None, :], float("-inf"))
    bits = biased.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits, so int order = float order
    keys = (ordered.to(tl.int64) << 32) | (W - 1 - ex)[None, :]
    j = tl.arange(0, K_PAD)
    ids = tl.zeros((t.shape[0], K_PAD), dtype=tl.int32)
    weights = tl.zeros((t.shape[0], K_PAD), dtype=tl.float32)
    for r in tl.static_range(TOPK):
        best = tl.max(keys, axis=1)
        ids = tl.where(j[None, :] == r, (W - 1 - (best & (W - 1))).to(tl.int32)[:, None], ids)
        picked = keys == best[:, None]  # one expert a row (the ids in the keys' low bits make them distinct)
        if not GATHER_LOADS:
            weights = tl.where(j[None, :] == r, tl.sum(tl.where(picked, scores, 0.0), axis=1)[:, None], weights)
        keys = tl.where(picked, -2 ** 63, keys)  # below every key: never picked again
    out_in = t_in[:, None] & (j < TOPK)[None, :]
    if GATHER_LOADS:
        weights = tl.load(scores_ptr + t[:, None] * E + ids, mask=out_in, other=0.0, cache_modifier=".cg")
    if NORMALIZE and TOPK > 1:
        weights = tl.div_rn(weights, tl.sum(weights, axis=1)[:, None] + 1e-20)
    out = t[:, None] * TOPK + j[None, :]
    tl.store(weights_ptr + out, weights * scale, mask=out_in)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_in)


@triton.jit
def _route_row(x_ptr, row, w_ptr, bias_ptr, weights_ptr, ids_ptr, E, scale, D: tl.constexpr, TOPK: tl.constexpr,
               K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_D: tl.constexpr, NORMALIZE: tl.constexpr):
    """The router of one bf16 row x[row, :D] by one program, for a gate of at most E_PAD experts (the mHC seam's
    finishing program routes the row it just normed: mhc_triton.py): fp32 logits from [E_PAD, BLOCK_D] tiles
    (bf16 products exact, summed per column over the tiles, then across the tile), sqrt-softplus, then _top_k.
    Only the summation order differs from the router kernel's."""
    e = tl.arange(0, E_PAD)
    e_in = e < E
    acc = tl.zeros((E_PAD, BLOCK_D), dtype=tl.float32)
    for d0 in tl.static_range(0, D, BLOCK_D):  # unrolled: every tile's loads can be in flight at once
        d = d0 + tl.arange(0, BLOCK_D)
        d_in = d < D
        x = tl.load(x_ptr + row * D + d, mask=d_in, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None] * D + d[None, :], mask=e_in[:, None] & d_in[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    scores = _sqrt_softplus(tl.sum(acc, axis=1))
    _top_k(row + tl.arange(0, 1), e, scores[None, :], _bias(bias_ptr, e, E), weights_ptr, weights_ptr, ids_ptr,
           row + 1, E, scale, TOPK, K_PAD, E_PAD, NORMALIZE, False)


def kernel_fits(x, weight, bias, topk) -> bool:
    """The inputs this kernel takes (else the op runs its reference): x bf16 or fp32 [N, D], a bf16 gate of at
    most MAX_EXPERTS_P2 experts (the top-k's registers), an fp32 bias, 1 <= topk <= E."""
    experts = weight.shape[0]
    return (x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32) and weight.dtype == torch.bfloat16
            and bias.dtype == torch.float32 and triton.next_power_of_2(experts) <= MAX_EXPERTS_P2
            and 1 <= topk <= experts)


def default_splits(tiles: int, k_blocks: int) -> int:
    """D splits that bring (token block, expert block) tiles up to about TARGET_PROGRAMS programs, each split at
    least MIN_K_BLOCKS_PER_SPLIT column blocks long."""
    return max(1, min(k_blocks // MIN_K_BLOCKS_PER_SPLIT, TARGET_PROGRAMS // tiles))


def fused_router_triton(x, weight, bias, topk, normalize, scale, splits=None, launch_tokens=None, early_gate=None):
    """(weights fp32 [N, topk], ids int64 [N, topk]) as the reference. splits: D splits (None: default_splits);
    launch_tokens: tokens per launch (None: as many as one launch's counters allow, below); early_gate: the
    EARLY_GATE launch (None: `takes_early_gate`; splits then ignored)."""
    tokens, experts = x.shape[0], weight.shape[0]
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    weights = x.new_empty(tokens, topk, dtype=torch.float32)
    ids = x.new_empty(tokens, topk, dtype=torch.int64)
    # A launch takes expert blocks + 1 counters per token block. Staying within the persistent buffer's
    # COUNTER_SLOTS (2608 tokens at 384 experts) means it is never replaced, which would leave the graphs
    # captured with it pointing at freed memory; longer prefill chunks take several launches.
    chunk = launch_tokens or BLOCK_T * (COUNTER_SLOTS // (triton.cdiv(experts, BLOCK_E) + 1))
    for start in range(0, tokens, chunk):
        rows = slice(start, start + chunk)
        _launch(x[rows], weight, bias, weights[rows], ids[rows], topk, normalize, scale, splits, early_gate)
    return weights, ids


def takes_early_gate(tokens: int, experts: int) -> bool:
    """The EARLY_GATE launch's shapes: one (token block, expert block) tile, as flash-40l-e8's 8 experts at decode."""
    return tokens <= BLOCK_T and experts <= BLOCK_E


def _launch(x, weight, bias, weights, ids, topk, normalize, scale, splits, early_gate):
    """One kernel launch for the tokens of x, into weights and ids (contiguous, tokens first)."""
    tokens, dim = x.shape
    experts = weight.shape[0]
    early = takes_early_gate(tokens, experts) if early_gate is None else early_gate
    block_k = EARLY_BLOCK_K if early else BLOCK_K
    token_blocks, expert_blocks, k_blocks = (triton.cdiv(tokens, BLOCK_T), triton.cdiv(experts, BLOCK_E),
                                             triton.cdiv(dim, block_k))
    if early:
        splits = k_blocks
    k_per_split = triton.cdiv(k_blocks, splits or default_splits(token_blocks * expert_blocks, k_blocks))
    splits = triton.cdiv(k_blocks, k_per_split)  # no split left without columns
    partial = x.new_empty(tokens, splits, experts, dtype=torch.float32)
    scores = x.new_empty(tokens, experts, dtype=torch.float32)
    _router_kernel[(token_blocks, expert_blocks, splits)](
        x, weight, bias, partial, scores, block_counters(x.device, (expert_blocks + 1) * token_blocks), weights,
        ids, tokens, dim, experts, k_per_split, scale,
        TOPK=topk, K_PAD=triton.next_power_of_2(topk), E_PAD=triton.next_power_of_2(experts),
        SPLITS_PAD=triton.next_power_of_2(splits), BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=block_k,
        NORMALIZE=normalize, X_FP32=x.dtype == torch.float32, FP32_DOT=x.device.type != "cuda", EARLY_GATE=early,
        num_warps=warps_for(x.dtype), **launch_options(x.device))
