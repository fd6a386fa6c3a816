"""TMA kernel of `dsflash::bf16_linear` for one row of a large projection (the math: bf16_linear.py): the
attention's wq_b, wo_a and wo_b at decode batch 1.

Each program owns BLOCK_N outputs over all of K and takes its weight tiles by TMA (a host tensor descriptor):
a tile lands in shared memory with no registers or address arithmetic of the program's, so (LONG's launch) 5
tiles of 32 KB, 160 KB, are in flight a program. bf16_linear_triton.py's kernel (cp.async, 8 KB tiles, 2 stages) needs
K split three ways to fill the GPU and still reads wo_b slower. H200, wo_b (5120 x 8192, 84 MB) alone
(scripts/probe_read_bandwidth.py, 12-04 b3): 23.5 us at [64, 256] x 5 stages on 80 programs, against 27.7 for
bf16_linear_triton.py's default launch and 27.1 for cuBLAS; at 3 stages 27.7. Shorter rows (wq_b's K 1280, a
row of 5 tiles) take smaller tiles at 3 stages (SHORT): more programs an SM.

x is FP8-rounded per 32-column group as loaded (QUANT_X) and multiplied on tensor cores in a 16-row tile whose
other rows are zeros; fp32 sums, one rounding to bf16 (bf16 products are exact in fp32: only the summation
order differs from the reference's GEMM). With `rot` (passes/linear_rope.py: wq_b and its query's RoPE) the
epilogue rotates each head's tail as bf16_linear_triton.py's does, with the tile's (cos, sin) loaded after the
wait but before the K loop; with `norm_weight` (bf16_gemv's, passes/linear_norm.py: the query's RMSNorm before wq_b)
each program first takes x's sum of squares and norms x as it loads it, bf16_gemv's kernel's arithmetic.
"""

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .attention_triton import _dot
from .bf16_linear_gemv_triton import _input
from .bf16_linear_triton import _finish_tile, _rotation_tile
from .fp8_qdq_triton import _fp8_qdq_groups
from .pdl import launch_options, pdl_wait
from .prefetch_l2 import prefetch_rows_l2

# the launch of a row of at least LONG_K: [64, 256] tiles, 5 stages (5 x 32 KB of shared memory a program); of a
# shorter row [128, 128] tiles, 3 stages (b3 probe, wq_b's K 1280: 22.8 us against 23.5-33.7 at 5 or more stages,
# which leave fewer programs an SM, and 24.8-26.1 at [64, 256])
LONG_K = 4096
LONG = dict(block_n=64, block_k=256, num_stages=5, num_warps=4)
SHORT = dict(block_n=128, block_k=128, num_stages=3, num_warps=4)
# one-row projections with K (a group's) and weight bytes of at least these take the kernel: wq_b, wo_a and wo_b,
# not wq_a+wkv (18 MB: bf16_gemv's whole-row kernel) nor the indexer's wq_b (10 MB). H200, B1 step side by side
# (12-04 b7, the two as compile_and_profile variants of one run): 10.303 ms with wq_b and wo_a on it as well
# against 10.373 with wo_b only, logits bit-equal; wq_b 21.5 us of a layer's path against 22.6 on the tiled
# kernel, wo_a 19.2 against 19.4. wo_b alone (b5): 10.292 against 10.423 ms, 23.5 us of the path against 25.5
MIN_K = 1024
MIN_BYTES = 64 << 20
# With PDL, each program of a row of at least PREFETCH_MIN_K first asks L2 for its first PREFETCH_STAGES x
# num_stages tiles of weight (prefetch_l2.py), before its wait (0: off). It pays only in a GEMV's tail: wo_b's
# programs land as wo_a's leave (their shared memory does not fit beside them). H200, B1 side by side: wo_b only
# 10.246 ms against 10.260 without, each of 5 rounds lower (12-04 c4: wo_b 23.1 us of the path against 23.6; on
# c3's machine, where wo_b took 27.5, 24.7 with it); at 2 x 10.327. On all three projections 10.691 against
# 10.624 (c3: wq_b 23.8 us against 22.0, wo_a 22.0 against 19.3, the prefetch beside the latency-bound kernels
# before them; at 2 x 11.035)
PREFETCH_STAGES = 1
PREFETCH_MIN_K = 8192  # wo_b (the one-row projection right after another: wo_a)
MAX_NORM_K = 8192  # the longest row the NORM prologue holds at once (64 fp32 values a thread at 4 warps)


@triton.jit
def _tma_gemv_kernel(x_ptr, w_ptr, w_desc, out_ptr, rot_ptr, norm_w_ptr, K, n_per_group, head_dim, eps,
                     QUANT_X: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_ROW: tl.constexpr,
                     PAIRS: tl.constexpr, PREFETCH_K: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    """x [groups * K], out [N]; w_desc: the [N, K] weight (at w_ptr) in [BLOCK_N, BLOCK_K] tiles (columns past K
    arrive as zeros); BLOCK_N divides n_per_group, so a program's outputs read one group's inputs. NORM_ROW > 0
    (one group; a power of two >= K): x is first RMS-normed by norm_w (layers.RMSNorm, rounded to bf16), each
    program taking the row's sum of squares itself from one load of the whole row. PAIRS > 0: rot [PAIRS, 2];
    each head_dim-wide head's trailing PAIRS pairs rotated in the epilogue (bf16_linear_triton's _finish_tile),
    the tile's (cos, sin) loaded before the K loop. PREFETCH_K > 0: the program's rows' first PREFETCH_K columns
    (at most K) asked of L2 before the wait."""
    pid = tl.program_id(0)
    if PREFETCH_K > 0:  # a weight: no kernel writes it
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        prefetch_rows_l2(w_ptr + rows.to(tl.int64) * K, tl.minimum(K, PREFETCH_K) * 2)
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    row = tl.zeros((1,), dtype=tl.int32)  # the one row, as bf16_linear_triton's row tiles index it
    rotation = _rotation_tile(rot_ptr, row, row == 0, pid, head_dim, BLOCK_N, PAIRS) if PAIRS > 0 else None
    x_row = x_ptr + (pid * BLOCK_N // n_per_group) * K
    rstd = 0.0
    if NORM_ROW > 0:  # one round trip: a loop of tiles here cost 5 us of wq_b's path (12-04 d5)
        cols = tl.arange(0, NORM_ROW)
        xs = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xs * xs, 0) / K + eps)
    first = tl.arange(0, 16)[:, None] == 0  # the dot's tile: x in row 0, zeros below
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for kb in range(tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        if NORM_ROW > 0:  # normed, then FP8-rounded as bf16_gemv's kernel takes its input
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            x = _input(x, k, k < K, norm_w_ptr, rstd, QUANT_X, True, BLOCK_K)[None, :]
        else:
            x = tl.load(x_row + k[None, :], mask=(k < K)[None, :], other=0.0)
            if QUANT_X:  # E4M3 values times a power of two: exact in bf16
                x = _fp8_qdq_groups(x.to(tl.float32), 1, BLOCK_K)
        x = tl.where(first, x, 0.0).to(tl.bfloat16)
        acc += _dot(x, tl.trans(w_desc.load([pid * BLOCK_N, kb * BLOCK_K])), FP32_DOT)
    y = _finish_tile(tl.sum(acc, 0)[None, :], rotation, 1, BLOCK_N, PAIRS)
    tl.store(out_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], y)


def launch(k: int, **overrides) -> dict:
    """The launch (block_n, block_k, num_stages, num_warps, prefetch_stages) of a row of K, with overrides (sweeps,
    tests)."""
    return {**(LONG if k >= LONG_K else SHORT), "prefetch_stages": PREFETCH_STAGES if k >= PREFETCH_MIN_K else 0,
            **overrides}


def takes_shape(n: int, k: int, groups: int) -> bool:
    """An [n, k] weight of at least MIN_K a group and MIN_BYTES, outputs in whole blocks of its launch a group, rows
    of whole 16 bytes (what `takes` asks of the shape alone: passes/linear_norm.py)."""
    return k >= MIN_K and n * k * 2 >= MIN_BYTES and (n // groups) % launch(k)["block_n"] == 0 and k % 8 == 0


def takes_norm(k: int, groups: int) -> bool:
    """Whether the kernel norms x itself (NORM_ROW): one group, the row's K in registers at once."""
    return groups == 1 and k <= MAX_NORM_K


def takes(x, weight, groups) -> bool:
    """One row of a projection `takes_shape` takes, its weight contiguous at a 16-byte aligned address (TMA's
    rules)."""
    return (x.numel() == x.shape[-1] and takes_shape(*weight.shape, groups) and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0)


def bf16_linear_tma(x, weight, groups, quantize_x, rot=None, head_dim=0, norm_weight=None, norm_eps=0.0,
                    **overrides):
    """bf16 [..., N] as the reference for one row (any size; `takes`: where the op uses it); rot, head_dim: the op's
    RoPE epilogue; norm_weight, norm_eps (one group): x's RMSNorm first (bf16_gemv's); overrides: `launch`'s."""
    n, k = weight.shape
    if norm_weight is not None and not takes_norm(k, groups):
        raise ValueError(f"bf16_linear TMA: the input's norm needs one group and K <= {MAX_NORM_K} (the row in "
                         f"registers), got groups={groups}, K={k}")
    settings = launch(k, **overrides)
    block_n, block_k = settings["block_n"], settings["block_k"]
    if (n // groups) % block_n or block_k < 32 or block_k & (block_k - 1):
        raise ValueError(f"bf16_linear TMA: block_n={block_n} must divide a group's {n // groups} outputs and "
                         f"block_k={block_k} be a power of two >= 32 (whole FP8 groups)")
    out = x.new_empty(n)
    options = launch_options(x.device)
    prefetch = settings["prefetch_stages"] * settings["num_stages"] * block_k if options["PDL"] else 0
    pairs = 0 if rot is None else rot.shape[-2]
    _tma_gemv_kernel[(n // block_n,)](
        x.contiguous(), weight, TensorDescriptor.from_tensor(weight, [block_n, block_k]), out,
        out if rot is None else rot.contiguous(), x if norm_weight is None else norm_weight.contiguous(), k,
        n // groups, head_dim, norm_eps, QUANT_X=quantize_x, BLOCK_N=block_n, BLOCK_K=block_k,
        NORM_ROW=0 if norm_weight is None else triton.next_power_of_2(k), PAIRS=pairs, PREFETCH_K=prefetch,
        FP32_DOT=x.device.type != "cuda", num_stages=settings["num_stages"], num_warps=settings["num_warps"], **options)
    return out.view(*x.shape[:-1], n)

