"""Triton kernel of `dsflash::mhc_seam` / `dsflash::mhc_entry_seam` (see mhc.py for the math): one launch.

Grid: (block of BLOCK_T tokens, chunk of BLOCK_D columns of D). The 24 x (hc D) mixes GEMV is split over D so
that a single token still spreads the 2 MB fp32 `fn` (release dims) over the GPU; a program loads its fn
tile once and, for each of its tokens: expands the streams (hc_post, stored bf16), takes its share of the
24 mix dot products and of the two sums of squares (all hc D values for the mixes' RMS, the collapse for
the RMSNorm), and collapses with the lagged pre-mix (stored bf16, not yet normalised). Each program writes
its partials and bumps a per-block counter; the last program of a block adds the partials in chunk order
(deterministic), runs the sigmoids and the 20 Sinkhorn rounds in registers and stores (pre, post, comb), while
the one before it waits for those partials, normalises the block's collapsed rows in place and resets the
counter for the next launch (H200, 12-01, sweep_mhc.py --parts: 8.3 us at one token, 16.0 at 16, against
10.4 and 18.0 when one program ran the mixes and then the RMSNorm).

Rounding points are the reference's: fp32 math, bf16 casts of the new streams and of the collapse.
One token per program by default (block_t > 1 reuses the fn tile over a serial token loop, which the H200
sweep found slower); more than 16 tokens take wider D chunks. Full seams of ROWS_MIN_TOKENS tokens or more
run mhc_rows_triton.py's kernels instead (blocks of tokens, the mixes as a matmul, D split while few blocks,
then a finish per token). The counters (block_counters.py) are shared with the router kernel and a launch
leaves them at zero: one seam or router in flight per device on the "main" lane.

The overlapped seam (mhc_split.py, issue 8) launches this kernel twice with half of it switched off by the
runtime flags mixes and collapse: the sublayer's input (expansion, collapse, RMSNorm) and the mixes (GEMV,
sigmoids, Sinkhorn) of the new streams. All launches run one compiled kernel (the flags are not specialized),
so each half computes its values exactly as the one launch does: the same bits. The mixes half runs on a side
stream beside the router and seam kernels, so it counts on its own "side" lane.
"""

import torch
import triton
import triton.language as tl

from . import mhc_rows_triton
from .attention_triton import _num_sms
from .block_counters import block_counters
from .mhc import ROUTE_MAX_EXPERTS, ROWS_MIN_TOKENS, SEAM_BLOCK_D, partial_width
from .mhc_finish_triton import _finish_token
from .pdl import launch_options, pdl_wait
from .router_triton import _route_row


# The mixes' fn tile (a weight: no kernel writes it) loaded before the PDL wait (EARLY_FN), as the router's gate
# (router_triton.EARLY_GATE). In the sm_90 code of the decode launch the streams' loads come after the fn tile's
# (24 KB a program) and the barriers behind it, so its latency is the seam path's first step; before the wait
# it overlaps the kernels before. ROW_LOADS_FIRST: the sublayer's output, post, comb and the lagged pre loaded with
# the streams (masked by has_post / collapse rather than branched on them): otherwise they come after the barriers
# of the streams' load and of the mixes' sums, two more round trips. Both reorder loads only (the same bits).
# Measured (H200, 12-04 d1, B1 step, 5 rounds): 10.168 ms against 10.263 (each round lower); the two seams of a
# layer 5.0 + 4.7 us of its path against 7.4 + 5.7
EARLY_FN = True
ROW_LOADS_FIRST = True


# has_post, mixes, collapse are runtime flags, never specialized (do_not_specialize: Triton would compile a 1
# apart): the one launch and both split launches then run one binary, so their reductions add in the same order.
# As constexprs each variant was compiled on its own, and on the H200 (11-30) the split seam's bits differed
# from the fused one's (the sm_90 code gave some reductions other layouts, hence other summation orders).
@triton.jit(do_not_specialize=["has_post", "mixes", "collapse", "share_finish", "finish_mixes", "norm"])
def _seam_kernel(out_ptr, streams_ptr, post_ptr, comb_ptr, pre_lag_ptr, fn_ptr, scale_ptr, base_ptr, weight_ptr,
                 new_streams_ptr, normed_ptr, pre_out_ptr, post_out_ptr, comb_out_ptr, partial_ptr, counter_ptr,
                 gate_ptr, gate_bias_ptr, route_weights_ptr, route_ids_ptr,
                 N, norm_eps, hc_eps, iters, has_post, mixes, collapse, share_finish, finish_mixes, norm, experts,
                 route_scale, HC: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                 PART: tl.constexpr, CHUNKS_PAD: tl.constexpr, NORM_BLOCK: tl.constexpr, ROUTE_TOPK: tl.constexpr,
                 ROUTE_K_PAD: tl.constexpr, ROUTE_E_PAD: tl.constexpr, ROUTE_NORMALIZE: tl.constexpr,
                 EARLY_FN: tl.constexpr, ROW_LOADS_FIRST: tl.constexpr, PDL: tl.constexpr):
    """EARLY_FN, ROW_LOADS_FIRST: module notes."""
    if EARLY_FN:  # fn is a weight, which no kernel writes: its tile may load before the wait
        fn = _fn_tile(fn_ptr, mixes, HC, D, BLOCK_D, PART)
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    if not EARLY_FN:
        fn = _fn_tile(fn_ptr, mixes, HC, D, BLOCK_D, PART)
    block = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    MIX: tl.constexpr = (2 + HC) * HC
    i = tl.arange(0, HC)
    d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = d < D
    col = tl.arange(0, PART)  # partial row: MIX mix dot products, the streams' and the collapse's sum of squares
    sd = i[:, None] * D + d[None, :]
    for t in range(BLOCK_T):
        row = (block * BLOCK_T + t).to(tl.int64)
        if row < N:
            if ROW_LOADS_FIRST:  # masked by the flags rather than branched on them: issued with x's loads
                o, q, c = _post_inputs(out_ptr, post_ptr, comb_ptr, row, d, in_d, i, has_post != 0, HC, D)
                p = tl.load(pre_lag_ptr + row * HC + i, mask=collapse != 0, other=0.0)
            x = tl.load(streams_ptr + row * HC * D + sd, mask=in_d[None, :], other=0.0).to(tl.float32)
            if has_post != 0:  # Y_j = post_j * out + sum_i comb[i, j] X_i, rounded to bf16
                if not ROW_LOADS_FIRST:
                    o, q, c = _post_inputs(out_ptr, post_ptr, comb_ptr, row, d, in_d, i, True, HC, D)
                y = (q[:, None] * o[None, :] + tl.sum(c[:, :, None] * x[:, None, :], axis=0)).to(tl.bfloat16)
                tl.store(new_streams_ptr + row * HC * D + sd, y, mask=in_d[None, :])
                x = y.to(tl.float32)
            # the split launches (mixes or collapse off) store zeros for the sums they skip and compute the
            # others in the same code, so their results equal the one-launch seam's bit for bit
            mix = tl.zeros((PART,), dtype=tl.float32)
            streams_ss = tl.sum(mix, axis=0)
            collapse_ss = streams_ss
            if mixes != 0:
                mix = tl.sum(tl.sum(fn * x[None, :, :], axis=2), axis=1)
                streams_ss = tl.sum(tl.sum(x * x, axis=1), axis=0)
            if collapse != 0:
                if not ROW_LOADS_FIRST:
                    p = tl.load(pre_lag_ptr + row * HC + i)
                collapsed = tl.sum(p[:, None] * x, axis=0).to(tl.bfloat16)
                tl.store(normed_ptr + row * D + d, collapsed, mask=in_d)
                cf = collapsed.to(tl.float32)
                collapse_ss = tl.sum(cf * cf, axis=0)
            part = tl.where(col == MIX, streams_ss, tl.where(col == MIX + 1, collapse_ss, mix))
            tl.store(partial_ptr + (row * chunks + chunk) * PART + col, part)

    # norm off (mhc_deferred.py's norm=False, with the mixes left as partials): the collapse stays un-normed and no
    # program finishes the block, so the seam takes no counter at all
    finish = (mixes != 0) & (finish_mixes != 0)
    norm_rows = collapse * norm  # the RMSNorm of the collapsed rows, by the block's finishing program
    if finish | (norm_rows != 0):
        _count_and_finish(block, N, chunks, partial_ptr, counter_ptr, scale_ptr, base_ptr, weight_ptr, normed_ptr,
                          pre_out_ptr, post_out_ptr, comb_out_ptr, norm_eps, hc_eps, iters, finish, norm_rows,
                          share_finish, HC, D, PART, CHUNKS_PAD, NORM_BLOCK, BLOCK_T, gate_ptr, gate_bias_ptr,
                          route_weights_ptr, route_ids_ptr, experts, route_scale, ROUTE_TOPK, ROUTE_K_PAD,
                          ROUTE_E_PAD, ROUTE_NORMALIZE)


@triton.jit
def _post_inputs(out_ptr, post_ptr, comb_ptr, row, d, in_d, i, live, HC: tl.constexpr, D: tl.constexpr):
    """The sublayer's output columns (fp32), the row's post [HC] and comb [HC, HC] (`live` false: zeros, no loads)."""
    o = tl.load(out_ptr + row * D + d, mask=in_d & live, other=0.0).to(tl.float32)
    q = tl.load(post_ptr + row * HC + i, mask=live, other=0.0)
    c = tl.load(comb_ptr + row * HC * HC + i[:, None] * HC + i[None, :], mask=live, other=0.0)
    return o, q, c


@triton.jit
def _fn_tile(fn_ptr, mixes, HC: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PART: tl.constexpr):
    """The program's columns of the mixes' fn [(2 + HC) HC, HC D]: [PART, HC, BLOCK_D] fp32, zeros past the mixes'
    rows (and with mixes off)."""
    i = tl.arange(0, HC)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col = tl.arange(0, PART)
    return tl.load(fn_ptr + col[:, None, None] * (HC * D) + i[None, :, None] * D + d[None, None, :],
                   mask=(col < (2 + HC) * HC)[:, None, None] & (d < D)[None, None, :] & (mixes != 0), other=0.0)


@triton.jit
def _count_and_finish(block, N, chunks, partial_ptr, counter_ptr, scale_ptr, base_ptr, weight_ptr, normed_ptr,
                      pre_out_ptr, post_out_ptr, comb_out_ptr, norm_eps, hc_eps, iters, finish, collapse, share_finish,
                      HC: tl.constexpr, D: tl.constexpr, PART: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                      NORM_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, gate_ptr, gate_bias_ptr, route_weights_ptr,
                      route_ids_ptr, experts, route_scale, ROUTE_TOPK: tl.constexpr, ROUTE_K_PAD: tl.constexpr,
                      ROUTE_E_PAD: tl.constexpr, ROUTE_NORMALIZE: tl.constexpr):
    """The block's counter and its finish (the mixes with `finish`, the RMSNorm with `collapse`)."""
    tl.debug_barrier()  # every thread's stores are issued before the release below
    ticket = tl.atomic_add(counter_ptr + block, 1, sem="acq_rel")
    # Both halves on: the block's last two programs share the finish, so that the RMSNorm runs beside the mixes'
    # Sinkhorn instead of after it. The last one runs the mixes; the one before waits for the last's partials
    # and runs the RMSNorm. Only one program a block waits, and the host shares the finish only while blocks are
    # no more than SMs (_may_share_finish), so a waiter never starves the last program of a slot. Either half
    # computes what the one finishing program would: same bits.
    # share_finish is off under the interpreter, which runs the programs one after another.
    # finish_mixes off (mhc_deferred.py): the partials are an output, the mixes are finished by a later kernel.
    shared = (share_finish != 0) & finish & (collapse != 0) & (chunks > 1)
    if ticket == chunks - 1:
        _finish_block(block, N, chunks, partial_ptr, scale_ptr, base_ptr, weight_ptr, normed_ptr, pre_out_ptr,
                      post_out_ptr, comb_out_ptr, norm_eps, hc_eps, iters, HC, D, PART, CHUNKS_PAD, NORM_BLOCK,
                      BLOCK_T, finish.to(tl.int32), tl.where(shared, 0, collapse), gate_ptr, gate_bias_ptr,
                      route_weights_ptr, route_ids_ptr, experts, route_scale, ROUTE_TOPK, ROUTE_K_PAD, ROUTE_E_PAD,
                      ROUTE_NORMALIZE)
        if not shared:
            tl.atomic_xchg(counter_ptr + block, 0)
    elif shared & (ticket == chunks - 2):
        while tl.atomic_add(counter_ptr + block, 0, sem="acquire") < chunks:
            pass
        _finish_block(block, N, chunks, partial_ptr, scale_ptr, base_ptr, weight_ptr, normed_ptr, pre_out_ptr,
                      post_out_ptr, comb_out_ptr, norm_eps, hc_eps, iters, HC, D, PART, CHUNKS_PAD, NORM_BLOCK,
                      BLOCK_T, 0, collapse, gate_ptr, gate_bias_ptr, route_weights_ptr, route_ids_ptr, experts,
                      route_scale, ROUTE_TOPK, ROUTE_K_PAD, ROUTE_E_PAD, ROUTE_NORMALIZE)
        tl.atomic_xchg(counter_ptr + block, 0)  # after the last program's increment, which it waited for


@triton.jit
def _finish_block(block, N, chunks, partial_ptr, scale_ptr, base_ptr, weight_ptr, normed_ptr, pre_out_ptr,
                  post_out_ptr, comb_out_ptr, norm_eps, hc_eps, iters, HC: tl.constexpr, D: tl.constexpr,
                  PART: tl.constexpr, CHUNKS_PAD: tl.constexpr, NORM_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                  mixes, collapse, gate_ptr, gate_bias_ptr, route_weights_ptr, route_ids_ptr, experts, route_scale,
                  ROUTE_TOPK: tl.constexpr, ROUTE_K_PAD: tl.constexpr, ROUTE_E_PAD: tl.constexpr,
                  ROUTE_NORMALIZE: tl.constexpr):
    for t in range(BLOCK_T):
        row = (block * BLOCK_T + t).to(tl.int64)
        if row < N:
            _finish_token(row, chunks, partial_ptr, scale_ptr, base_ptr, weight_ptr, normed_ptr, pre_out_ptr,
                          post_out_ptr, comb_out_ptr, norm_eps, hc_eps, iters, HC, D, PART, CHUNKS_PAD,
                          NORM_BLOCK, mixes, collapse)
            if ROUTE_TOPK > 0:  # the program that normed the row routes it (the MoE's router, mhc_deferred.py)
                if collapse != 0:
                    tl.debug_barrier()  # the row's stores by this program's threads, before its loads
                    _route_row(normed_ptr, row, gate_ptr, gate_bias_ptr, route_weights_ptr, route_ids_ptr, experts,
                               route_scale, D, ROUTE_TOPK, ROUTE_K_PAD, ROUTE_E_PAD, ROUTE_BLOCK_D, ROUTE_NORMALIZE)


BLOCK_D = SEAM_BLOCK_D
WIDE_BLOCK_D = 128
NORM_BLOCK = 1024
# columns of a routing tile (its loop unrolled): at 8 experts 256 compiles for sm_90 without spills beside the
# deferred seam's 8192-wide RMSNorm tile, 512 and 1024 spilled 600 / 184 bytes (ptxas, 12-03 z)
ROUTE_BLOCK_D = tl.constexpr(256)


def _may_share_finish(device: torch.device, blocks: int) -> bool:
    """Whether two programs finish each block (share_finish's default): on CUDA, with at most one block per SM.
    Each block's waiting program holds its slot until the block's last program runs; with more blocks than SMs
    the waiters could fill every slot before the last programs are scheduled (they come last: the grid runs
    block-major) and the launch would hang, as it did at 1024 tokens (rows=False, H200, 12-02 o). With at
    most one waiter per SM and two or more programs resident per SM, a slot is always free."""
    return device.type == "cuda" and blocks <= _num_sms(device)


def kernel_fits(streams, fn=None) -> bool:
    """The shapes and dtypes this kernel takes (else the op runs its reference): bf16 streams, hc a power of 2,
    fp32 fn (None: a launch without the mixes)."""
    hc = streams.shape[-2]
    return streams.dtype == torch.bfloat16 and hc & (hc - 1) == 0 and (fn is None or fn.dtype == torch.float32)


def _columns_per_program(tokens: int) -> int:
    """BLOCK_D up to 16 tokens (H200 12-01: 8.3 us for one token, 9.6 with 128 columns), WIDE_BLOCK_D above:
    scripts/sweep_mhc.py (H200, 11-30) gave 33 us at 64 tokens and 366 us at 1024 with one token and 128
    columns per program, against 84 and 771 us for 16 tokens x 64 columns (the fn tile's reuse does not pay
    for the serial token loop and the serial finish of a block)."""
    return BLOCK_D if tokens <= 16 else WIDE_BLOCK_D


def takes_rows(tokens: int, mixes: bool, collapse: bool) -> bool:
    """Whether mhc_seam_triton runs mhc_rows_triton.py's kernels: full seams of ROWS_MIN_TOKENS tokens or more.
    The split launches (mixes or collapse off) always take _seam_kernel: they must equal its one launch."""
    return mixes and collapse and tokens >= ROWS_MIN_TOKENS


def mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight, norm_eps, hc_eps, iters,
                    block_t=1, block_d=None, num_warps=4, norm_block=None, share_finish=None, mixes=True,
                    collapse=True, rows=None, rows_launch=None, finish_mixes=True, route=None, norm=True,
                    early_fn=None, row_loads_first=None):
    """Both ops: with out/post/comb None (the entry seam) returns (normed, pre, post, comb), else
    (new streams, normed, pre, post, comb); shapes as the ops' references. block_t (tokens per program),
    block_d (columns per program), num_warps, norm_block (the finish's RMSNorm tile) and share_finish (two
    programs finish a block; default: on CUDA) override _seam_kernel's launch (scripts/sweep_mhc.py).
    rows: None takes mhc_rows_triton.py's kernels where `takes_rows` says, True or False forces it or not (full
    seams only); rows_launch overrides its launch (keys of mhc_rows_triton.LAUNCH).
    The split seam (custom_ops/mhc_split.py) launches _seam_kernel twice: mixes=False (fn, scale, base
    unused) returns the outputs above without (pre, post, comb); collapse=False (pre_lagged, norm_weight
    unused; out/post/comb None) returns (pre, post, comb) only, counting on the side lane.
    finish_mixes=False (mhc_deferred.py; mixes and collapse on, not rows): the mixes are left as partials,
    returned in place of (pre, post, comb): [tokens, chunks, partial_width(hc)] fp32.
    route (gate, bias, topk, normalize, scale; collapse on, not rows, at most ROUTE_MAX_EXPERTS experts): the
    program that norms a row also routes it as dsflash::fused_router would; (weights fp32, ids int64)
    [tokens, topk] are returned last. norm=False (the deferred seam: finish_mixes off, collapse on, no route): the
    collapse is returned un-normed in normed's place, and the kernel takes no counter (mhc_deferred.py).
    early_fn, row_loads_first: _seam_kernel's EARLY_FN, ROW_LOADS_FIRST (None: the module's)."""
    *lead, hc, dim = streams.shape
    tokens = streams.numel() // (hc * dim)
    rows = takes_rows(tokens, mixes, collapse) if rows is None else rows
    if rows and not (mixes and collapse and finish_mixes):
        raise ValueError("mhc seam: the rows kernel runs full seams only (mixes and collapse on, finished)")
    if not finish_mixes and not (mixes and collapse):
        raise ValueError("mhc seam: finish_mixes=False leaves the mixes of a full seam as partials")
    if not norm and (rows or finish_mixes or not collapse or route is not None):
        raise ValueError("mhc seam: norm=False leaves a deferred seam's collapse un-normed (finish_mixes off, "
                         "collapse on, no route)")
    if route is not None and (rows or not collapse or route[0].shape[0] > ROUTE_MAX_EXPERTS):
        raise ValueError(f"mhc seam: routing needs the collapse, not the rows kernel, and at most "
                         f"{ROUTE_MAX_EXPERTS} experts (got {route[0].shape[0]})")
    flat = streams.reshape(tokens, hc, dim).contiguous()
    has_post = out is not None
    new_streams = torch.empty_like(flat) if has_post else flat
    unused = flat  # any tensor, for the pointers a launch's flags leave unread
    normed = flat.new_empty(tokens, dim) if collapse else unused
    finished = mixes and finish_mixes
    pre_out = flat.new_empty(tokens, hc, dtype=torch.float32) if finished else unused
    post_out = torch.empty_like(pre_out) if finished else unused
    comb_out = flat.new_empty(tokens, hc, hc, dtype=torch.float32) if finished else unused
    tensors = (out.reshape(tokens, dim).contiguous() if has_post else flat,
               flat,
               post.reshape(tokens, hc).contiguous() if has_post else unused,
               comb.reshape(tokens, hc, hc).contiguous() if has_post else unused,
               pre_lagged.reshape(tokens, hc).float().contiguous() if collapse else unused,
               fn.contiguous() if mixes else unused, scale.float().contiguous() if finished else unused,
               base.float().contiguous() if finished else unused, norm_weight.contiguous() if collapse else unused,
               new_streams, normed, pre_out, post_out, comb_out)
    gate, gate_bias, topk, normalize, route_scale = route or (unused, unused, 0, False, 0.0)
    route_weights = flat.new_empty(tokens, topk, dtype=torch.float32) if route else unused
    route_ids = flat.new_empty(tokens, topk, dtype=torch.int64) if route else unused
    if rows:
        if tokens:
            mhc_rows_triton.seam_rows(*tensors, norm_eps, hc_eps, iters, has_post, rows_launch)
    else:
        block_d = block_d or _columns_per_program(tokens)
        chunks, blocks = triton.cdiv(dim, block_d), triton.cdiv(tokens, block_t)
        partial = flat.new_empty(tokens, chunks, partial_width(hc), dtype=torch.float32)
        if tokens:
            _seam_kernel[(blocks, chunks)](
                *tensors, partial, block_counters(flat.device, blocks, "main" if collapse else "side"),
                gate.contiguous(), gate_bias.contiguous(), route_weights, route_ids, tokens, norm_eps, hc_eps, iters,
                int(has_post), int(mixes), int(collapse),
                int(_may_share_finish(flat.device, blocks) if share_finish is None else share_finish),
                int(finish_mixes), int(norm), gate.shape[0] if route else 0, float(route_scale), HC=hc, D=dim,
                BLOCK_D=block_d, BLOCK_T=block_t, PART=partial.shape[2], CHUNKS_PAD=triton.next_power_of_2(chunks),
                NORM_BLOCK=min(norm_block or NORM_BLOCK, triton.next_power_of_2(dim)), ROUTE_TOPK=topk,
                ROUTE_K_PAD=triton.next_power_of_2(max(topk, 1)),
                ROUTE_E_PAD=triton.next_power_of_2(gate.shape[0]) if route else 1, ROUTE_NORMALIZE=bool(normalize),
                EARLY_FN=EARLY_FN if early_fn is None else early_fn,
                ROW_LOADS_FIRST=ROW_LOADS_FIRST if row_loads_first is None else row_loads_first, num_warps=num_warps,
                **launch_options(flat.device))
    lead = tuple(lead)
    outputs = [new_streams.view(lead + (hc, dim))] if has_post else []
    if collapse:
        outputs.append(normed.view(lead + (dim,)))
    if finished:
        outputs += [pre_out.view(lead + (hc,)), post_out.view(lead + (hc,)), comb_out.view(lead + (hc, hc))]
    elif mixes:
        outputs.append(partial.view(lead + partial.shape[1:]))
    if route:
        outputs += [route_weights, route_ids]
    return tuple(outputs)
