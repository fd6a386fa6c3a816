"""Triton kernel of `dsflash::bf16_gemv` (bf16_gemv.py; the math: bf16_linear.py), one row of a projection with a
weight of up to ~24 MB: each program loads its whole weight tile at once (whole rows, several tiles: one after
another unless AT_ONCE).

bf16_linear_triton.py streams a tile through a software pipeline over K (a few blocks in flight a program). For
the fused input projection at decode batch 1 (wq_a+wkv: 1792 x 5120, 18 MB) its programs are three K blocks
long, so the pipeline's ramp is most of their time. Here the weight is cut into [BLOCK_N, BLOCK_K] = 16 x 1024
tiles (32 KB, ~160 registers a thread at 4 warps; 32 x 1024 spills on sm_90), one a program, loaded in one go:
every load of the tile is in flight at once. H200 (sweep_linear.py --after-seam, 12-03 u): wq_a+wkv after an
mHC seam, as a layer runs it, 9.9 us against 12.5 for the tiled kernel.

Grid (output block, K split). A program multiplies its tile by x's slice on the CUDA cores (one row: a dot's
16-row tile would be 15/16 zeros) and sums each output's products in fp32; splits store fp32 partials and the
last program of an output block adds them in split order (same bits whichever arrives last), rounds to bf16
and resets the block's counter (block_counters.py). The products are exact in fp32, so only the summation
order differs from the reference's GEMM.

An fp32 weight (dsflash::fp32_gemv: the compressors' fused wkv + wgate) takes the same kernel: tiles of half the
columns (the same bytes), products and sums in fp32 as ever, the sums stored as they are (no bf16 rounding).

Loading the tile before the PDL wait (while the seam runs) was measured and dropped: the seam, a chain of
dependent memory accesses, slowed by what the projection gained (12-03 u: seam 10.3 us against 8.4 on the
decode step's path; after a seam 10.7 us against 9.9 for the projection with its tile loaded after the wait).

EARLY (the op's `early`, set by passes/early_reads.py where a kernel computed from x's producer runs between it and
this one, so x is final once this kernel is scheduled: pdl.py) reads x and the weight and takes the sums before the
wait, which then comes before the first store: the projection works beside the kernel before it. Meant for a
projection after one that streams a large weight (the indexer's wq_b after the attention's), whose programs hold
most of each SM: an early launch (`early_launch`) keeps to one program an SM with no shared memory, the K loop
not unrolled where the default launch has more programs.
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _num_sms
from .bf16_bits import _round_bf16
from .block_counters import block_counters
from .fp8_qdq_triton import _fp8_qdq_groups
from .pdl import launch_options, pdl_wait

BLOCK_N = 16
BLOCK_K = 1024
NUM_WARPS = 4
K_CHUNKS = 1
# Whole rows: a row of at least WHOLE_ROW_MIN_TILES tiles of K, with outputs enough for WHOLE_ROW_BLOCK_N a program
# to give 2 programs an SM, takes each program's outputs over all of K (no split, so no partials to finish):
# [4, 1024] x 5 tiles, 8 warps. H200, wq_a+wkv after an mHC seam (sweep_linear.py --after-seam, 12-03 a1): 8.53 us
# against 9.52 for [16, 1024] tiles in 5 splits (8.81 at 4 warps, 8.91 at 8 outputs a program, 9.63 at 2)
WHOLE_ROW_BLOCK_N = 4
WHOLE_ROW_WARPS = 8
WHOLE_ROW_MIN_TILES = 4
WHOLE_ROW_MAX_TILES = 5  # the registers of 40 KB of weight a program (longer rows: not measured)
# H200: 24 MB, so wq_a+wkv (18 MB) and the indexer's wq_b (10 MB). Larger weights keep bf16_linear's pipelined
# kernel: at one row alone (sweep_linear.py --grid none, 12-03 v) this kernel took wq_b 26.7-34.8 us against 22.9,
# wo_a 20.6-28.9 against 18.9, wo_b 25.0 against 30.7; with no cap the B1 step took 11.18 ms against 10.65 (wq_b
# 31.4 us on the step's path against 22.8, wo_b 23.9 against 23.4)
MAX_BYTES_PER_SM = 192 * 1024
# A program's K_CHUNKS tiles loaded before any arithmetic (AT_ONCE), so all of them are in flight together: tile by
# tile, the FP8 rounding's and the sums' barriers (bar.sync) come between one tile's loads and the next's, and
# ptxas does not move loads across them (sm_90 PTX of the default whole-row launch: 5 load groups, each after the
# previous tile's barriers; AT_ONCE: all 20 vector loads first). Measured (H200, 12-04 d1): wq_a+wkv alone 6.84 us
# against 7.95 (probe_read_bandwidth.py), but on the B1 step's path 7.3 against 7.2 and the step 10.237 ms against
# 10.263 (2 of 5 rounds lower: noise); with the seams' early loads 10.160 against 10.168: off
AT_ONCE = False
# An early launch's tile (values) and most tiles a program in its K loop (`early_launch`): the indexer's wq_b
# (4096 x 1280) as 128 programs of [32, 256] x 5 tiles, where the default launch has 512 programs of [16, 1024]
# (two splits). Not measured yet (12-05 f: no GPU): `early-gemv` in scripts/compile_and_profile.py
EARLY_TILE = 8192
EARLY_MAX_TILES = 8


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, counter_ptr, norm_w_ptr, N, K, n_per_group, eps, scale,
                 QUANT_X: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr,
                 NORM: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr, EARLY: tl.constexpr,
                 LOOP: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
    """x [groups * K] and out [N]; weight [N, K]; BLOCK_N divides n_per_group. A program's split is K_CHUNKS
    tiles of BLOCK_K columns, unrolled (their loads in flight one tile after another: AT_ONCE) unless LOOP. NORM
    (one group, one split: the program holds the whole row): x is first RMS-normed by norm_w (layers.RMSNorm,
    rounded to bf16), each program taking the row's sum of squares itself (the mHC seam before it then has no norm
    to finish). HEAD > 0 (AT_ONCE): the split's tiles loaded at once, as [BLOCK_N, HEAD] and [BLOCK_N, TAIL] tiles.
    EARLY: every load and sum before the PDL wait (module notes). SCALED: the bf16 outputs times scale, rounded to
    bf16 again (the op's out_scale)."""
    if not EARLY:
        pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    pid_n, split = tl.program_id(0), tl.program_id(1)
    splits = tl.num_programs(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    group = pid_n * BLOCK_N // n_per_group
    if HEAD > 0:
        acc = _split_at_once(x_ptr, w_ptr, norm_w_ptr, n, group, split, K, eps, QUANT_X, BLOCK_K, K_CHUNKS, NORM,
                             HEAD, TAIL)
    else:
        acc = _split_by_tiles(x_ptr, w_ptr, norm_w_ptr, n, group, split, K, eps, QUANT_X, BLOCK_N, BLOCK_K, K_CHUNKS,
                              NORM, LOOP)
    if EARLY:  # x's producer has finished (the op's `after`); the kernel before may still read what this one writes
        pdl_wait(PDL)
    if splits == 1:
        tl.store(out_ptr + n, _output(acc, out_ptr, scale, SCALED))
    else:
        tl.store(partial_ptr + split * N + n, acc)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        if tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel") == splits - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in range(splits):  # split order: deterministic
                total += tl.load(partial_ptr + s * N + n, cache_modifier=".cg")
            tl.store(out_ptr + n, _output(total, out_ptr, scale, SCALED))
            tl.atomic_xchg(counter_ptr + pid_n, 0)


@triton.jit
def _output(acc, out_ptr, scale, SCALED: tl.constexpr):
    """The sums as out holds them: fp32 as they are (an fp32 projection, fp32_gemv.py), else rounded to bf16 (with
    SCALED, then times scale in fp32 and rounded again, as a bf16 tensor's multiply by a float rounds)."""
    FP32: tl.constexpr = out_ptr.dtype.element_ty == tl.float32
    if FP32:
        return acc
    else:
        y = _round_bf16(acc)
        if SCALED:
            y = _round_bf16(y * scale)
        return y.to(tl.bfloat16)


@triton.jit
def _split_by_tiles(x_ptr, w_ptr, norm_w_ptr, n, group, split, K, eps, QUANT_X: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr, NORM: tl.constexpr, LOOP: tl.constexpr):
    """The split's fp32 sums of products, tile by tile (LOOP: in a loop not unrolled, one tile's registers)."""
    rstd = 0.0
    if NORM:
        ss = tl.zeros((), dtype=tl.float32)
        for c in tl.static_range(K_CHUNKS):
            k = c * BLOCK_K + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            ss += tl.sum(xs * xs, 0)
        rstd = tl.math.rsqrt(ss / K + eps)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if LOOP:
        for c in range(K_CHUNKS):
            acc += _tile_sums(x_ptr, w_ptr, norm_w_ptr, n, group, split * K_CHUNKS + c, K, rstd, QUANT_X, BLOCK_K,
                              NORM)
    else:
        for c in tl.static_range(K_CHUNKS):
            acc += _tile_sums(x_ptr, w_ptr, norm_w_ptr, n, group, split * K_CHUNKS + c, K, rstd, QUANT_X, BLOCK_K,
                              NORM)
    return acc


@triton.jit
def _tile_sums(x_ptr, w_ptr, norm_w_ptr, n, group, tile, K, rstd, QUANT_X: tl.constexpr, BLOCK_K: tl.constexpr,
               NORM: tl.constexpr):
    """Each of the rows n's fp32 sum of products over K's tile `tile`."""
    k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=(k < K)[None, :], other=0.0)
    x = tl.load(x_ptr + group * K + k, mask=k < K, other=0.0).to(tl.float32)
    x = _input(x, k, k < K, norm_w_ptr, rstd, QUANT_X, NORM, BLOCK_K)
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _span(x_ptr, w_ptr, n, group, start, stop, K, WIDTH: tl.constexpr):
    """The weight tile [BLOCK_N, WIDTH] and x (fp32) of columns start.. (masked at stop and K)."""
    k = start + tl.arange(0, WIDTH)
    live = (k < stop) & (k < K)
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=live[None, :], other=0.0)
    return w, tl.load(x_ptr + group * K + k, mask=live, other=0.0).to(tl.float32), k, live


@triton.jit
def _input(x, k, live, norm_w_ptr, rstd, QUANT_X: tl.constexpr, NORM: tl.constexpr, WIDTH: tl.constexpr):
    """x as the products take it: normed (layers.RMSNorm: weight * (x * rstd), rounded to bf16), FP8-rounded in
    groups of 32 (a tile or span starts on a multiple of 32; its padding is zeros)."""
    if NORM:
        x = _round_bf16(tl.load(norm_w_ptr + k, mask=live, other=0.0).to(tl.float32) * (x * rstd))
    if QUANT_X:
        x = tl.reshape(_fp8_qdq_groups(tl.reshape(x, (1, WIDTH)), 1, WIDTH), (WIDTH,))
        x = x.to(tl.bfloat16).to(tl.float32)  # E4M3 values times a power of two: exact in bf16
    return x


@triton.jit
def _split_at_once(x_ptr, w_ptr, norm_w_ptr, n, group, split, K, eps, QUANT_X: tl.constexpr, BLOCK_K: tl.constexpr,
                   K_CHUNKS: tl.constexpr, NORM: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr):
    """The split's fp32 sums of products, its K_CHUNKS tiles loaded by two statements (AT_ONCE; HEAD + TAIL
    columns, powers of two, so no register holds padding: 4096 + 1024 for wq_a+wkv's row), every weight load
    issued before the first barrier."""
    start = split * (K_CHUNKS * BLOCK_K)
    stop = start + K_CHUNKS * BLOCK_K
    w, x, k, live = _span(x_ptr, w_ptr, n, group, start, stop, K, HEAD)
    if TAIL > 0:
        w_tail, x_tail, k_tail, live_tail = _span(x_ptr, w_ptr, n, group, start + HEAD, stop, K, TAIL)
    rstd = 0.0
    if NORM:  # one split: the whole row
        squares = tl.sum(x * x, 0)
        if TAIL > 0:
            squares += tl.sum(x_tail * x_tail, 0)
        rstd = tl.math.rsqrt(squares / K + eps)
    acc = tl.sum(w.to(tl.float32) * _input(x, k, live, norm_w_ptr, rstd, QUANT_X, NORM, HEAD)[None, :], axis=1)
    if TAIL > 0:
        x_tail = _input(x_tail, k_tail, live_tail, norm_w_ptr, rstd, QUANT_X, NORM, TAIL)
        acc += tl.sum(w_tail.to(tl.float32) * x_tail[None, :], axis=1)
    return acc

def spans(columns: int) -> tuple[int, int] | None:
    """A split's columns as AT_ONCE loads them: (head, tail), powers of two (tail 0: none), or None."""
    head = 1 << (columns.bit_length() - 1)
    tail = columns - head
    return (head, tail) if tail & (tail - 1) == 0 else None


def takes(rows: int, n: int, k: int, groups: int, sms: int | None, itemsize: int = 2) -> bool:
    """Whether a projection of this shape takes this kernel: one row, outputs a 16-wide block divides per group,
    a weight (itemsize bytes a value) of at most MAX_BYTES_PER_SM on each of `sms` SMs (None: any size, the
    interpreter's tests)."""
    if rows != 1 or (n // groups) % BLOCK_N:
        return False
    return sms is None or n * k * itemsize <= MAX_BYTES_PER_SM * sms


def fits(x, weight, groups) -> bool:
    """`takes` for the op's inputs."""
    n, k = weight.shape
    return takes(x.numel() // (groups * k), n, k, groups, _num_sms(x.device) if x.device.type == "cuda" else None,
                 weight.element_size())


def launch(n: int, k: int, groups: int, sms: int, itemsize: int = 2) -> dict:
    """The default launch (block_n, block_k, num_warps, k_chunks) of an [n, k] weight: whole rows where the module's
    WHOLE_ROW_* rule takes the shape, else [BLOCK_N, BLOCK_K] tiles, K split. A tile holds BLOCK_K bf16 columns'
    bytes (fp32 weights: half the columns; twice would spill)."""
    block_k = BLOCK_K * 2 // itemsize
    tiles = triton.cdiv(k, block_k)
    if (WHOLE_ROW_MIN_TILES <= tiles <= WHOLE_ROW_MAX_TILES and (n // groups) % WHOLE_ROW_BLOCK_N == 0
            and n // WHOLE_ROW_BLOCK_N >= 2 * sms):
        return dict(block_n=WHOLE_ROW_BLOCK_N, block_k=block_k, num_warps=WHOLE_ROW_WARPS, k_chunks=tiles)
    return dict(block_n=BLOCK_N, block_k=block_k, num_warps=NUM_WARPS, k_chunks=K_CHUNKS)


def early_launch(n: int, k: int, groups: int, sms: int, itemsize: int = 2) -> dict:
    """The launch of an early GEMV (the op's `early`): the default launch where its programs are no more than SMs,
    else whole rows in a K loop (`loop`) of [block_n, EARLY_TILE / block_n] tiles, block_n the least power of two
    (>= BLOCK_N) giving one program an SM, where that takes at most EARLY_MAX_TILES tiles a program."""
    chosen = dict(launch(n, k, groups, sms, itemsize), loop=False)
    splits = triton.cdiv(k, chosen["block_k"] * chosen["k_chunks"])
    block_n = max(BLOCK_N, triton.next_power_of_2(triton.cdiv(n, sms)))
    block_k = max(32, EARLY_TILE * 2 // itemsize // block_n)
    tiles = triton.cdiv(k, block_k)
    if n // chosen["block_n"] * splits <= sms or (n // groups) % block_n or tiles > EARLY_MAX_TILES:
        return chosen
    return dict(block_n=block_n, block_k=block_k, num_warps=NUM_WARPS, k_chunks=tiles, loop=True)


def takes_norm(n: int, k: int, groups: int, sms: int) -> bool:
    """Whether the default launch of an [n, k] weight holds whole rows, which the NORM prologue needs."""
    chosen = launch(n, k, groups, sms)
    return groups == 1 and chosen["k_chunks"] * chosen["block_k"] >= k


def bf16_linear_gemv(x, weight, groups, quantize_x, block_n=None, block_k=None, num_warps=None, k_chunks=None,
                     norm_weight=None, eps=0.0, at_once=None, early=False, loop=None, out_scale=1.0):
    """bf16 [..., N] as the reference, for one row (`fits`; an fp32 weight: its fp32 sums, fp32_gemv.py); block_n,
    block_k (powers of two, block_n dividing a group's outputs), num_warps, k_chunks (tiles a program) and loop
    (the K loop not unrolled) override `launch`'s (`early_launch`'s with early) (scripts/sweep_linear.py).
    norm_weight (one group, whole rows a program): x RMS-normed by it first (the kernel's NORM). at_once: the
    tiles loaded at once (None: AT_ONCE; not in a loop). early: the kernel's EARLY (module notes): the caller
    vouches that x's producer has finished once the kernel before this one is past its wait. out_scale: the bf16
    outputs times it, rounded again (bf16 weights only)."""
    n, k = weight.shape
    early = early and x.is_contiguous() and weight.is_contiguous()  # a copy's kernel would be the one just before
    default = (early_launch if early else launch)(n, k, groups, _num_sms(x.device), weight.element_size())
    block_n, block_k = block_n or default["block_n"], block_k or default["block_k"]
    num_warps, k_chunks = num_warps or default["num_warps"], k_chunks or default["k_chunks"]
    loop = default.get("loop", False) if loop is None else loop
    if (n // groups) % block_n or block_k < 32 or block_k & (block_k - 1):
        raise ValueError(f"bf16_gemv: block_n={block_n} must divide a group's {n // groups} outputs and "
                         f"block_k={block_k} be a power of two >= 32 (whole FP8 groups)")
    block_k = min(block_k, triton.next_power_of_2(k))
    k_chunks = min(k_chunks, triton.cdiv(k, block_k))
    splits = triton.cdiv(k, block_k * k_chunks)
    at_once = not loop and (AT_ONCE if at_once is None else at_once)
    head, tail = (spans(k_chunks * block_k) if at_once else None) or (0, 0)
    if out_scale != 1.0 and weight.dtype == torch.float32:
        raise ValueError("bf16_gemv: out_scale scales bf16 outputs; an fp32 projection's sums are stored as they are")
    if norm_weight is not None and (groups != 1 or splits != 1):
        raise ValueError(f"bf16_gemv: the input's norm needs one group and whole rows a program, got groups={groups} "
                         f"and {splits} splits of K")
    out = x.new_empty(n, dtype=torch.float32 if weight.dtype == torch.float32 else torch.bfloat16)
    partial = x.new_empty(splits * n if splits > 1 else 1, dtype=torch.float32)
    counters = block_counters(x.device, n // block_n) if splits > 1 else partial
    _gemv_kernel[(n // block_n, splits)](
        x.contiguous(), weight.contiguous(), out, partial, counters,
        x if norm_weight is None else norm_weight.contiguous(), n, k, n // groups, eps, out_scale, QUANT_X=quantize_x,
        BLOCK_N=block_n, BLOCK_K=block_k, K_CHUNKS=k_chunks, NORM=norm_weight is not None,
        HEAD=head, TAIL=tail, EARLY=early, LOOP=loop, SCALED=out_scale != 1.0, num_warps=num_warps,
        **({"num_stages": 1} if loop else {}), **launch_options(x.device))  # a loop's tiles: registers, no stages
    return out.view(*x.shape[:-1], n)
