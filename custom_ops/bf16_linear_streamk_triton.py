"""Stream-K kernel of `dsflash::bf16_linear` for one row (the math: bf16_linear.py): the weight cut into equal
shares, one a program, whatever the output count.

At decode batch 1 the large projections (wq_b 84 MB, wo_a 67 MB, wo_b 84 MB) ran on bf16_linear_triton.py's
tiled kernel at 3.3-3.6 TB/s, where the routed experts' up kernel streams 330 MB at 4.0 (H200 trace, 12-03 a3).
Their grids are output blocks times K splits: wo_b's 160 x 3 = 480 programs leave 84 SMs with four and 48 with
three, so the GPU waits on the first 84; wq_b's programs run 10 K blocks, mostly the pipeline's ramp. Here the
weight is a list of [BLOCK_N, BLOCK_K] units, output block major, and program p takes units [p U / P, (p + 1) U / P):
every program the same bytes to within a unit, in one long pipelined loop.

An output block whose units lie in one program is finished there; one cut between two programs (the grid has at
most one program per output block, so a share is at least a block's units and no block spans three) is finished
by the second to arrive: each stores its fp32 partial, bumps the block's counter (block_counters.py) and the last
adds the two in unit order (the same bits whichever arrives last), rounds to bf16 and resets the counter.

Numerics as the tiled kernel's: bf16 products exact in fp32, fp32 sums (tensor cores on a 16-row tile whose other
rows are zeros), x FP8-rounded per 32-column group as loaded (QUANT_X), the output rounded to bf16 once.
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot, _num_sms
from .block_counters import block_counters
from .pdl import launch_options, pdl_wait
from .routed_experts_triton import _fp8_qdq_groups, _round_bf16

BLOCK_N = 32
BLOCK_K = 128
PROGRAMS_PER_SM = 1
NUM_WARPS = 4
NUM_STAGES = 4


@triton.jit
def _streamk_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, counter_ptr, N, K, n_per_group, k_units, units,
                    QUANT_X: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    """x [groups * K] and out [N]; weight [N, K]; BLOCK_N divides n_per_group. k_units = cdiv(K, BLOCK_K) units
    an output block, units = k_units * N / BLOCK_N in all; partial [N / BLOCK_N, 2, BLOCK_N] fp32."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    start = (pid * units) // programs
    end = ((pid + 1) * units) // programs
    row = tl.arange(0, 16)[:, None] == 0  # the dot's tile: x in row 0, zeros below
    j = tl.arange(0, BLOCK_N)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for u in range(start, end):
        block = u // k_units
        kb = u - block * k_units
        n = block * BLOCK_N + j
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_in = (k < K) | EVEN_K
        x = tl.load(x_ptr + (block * BLOCK_N // n_per_group) * K + k[None, :], mask=k_in[None, :], other=0.0)
        if QUANT_X:  # E4M3 values times a power of two: exact in bf16
            x = _fp8_qdq_groups(x.to(tl.float32), 1, BLOCK_K)
        x = tl.where(row, x, 0.0).to(tl.bfloat16)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=k_in[None, :], other=0.0)
        acc += _dot(x, tl.trans(w), FP32_DOT)
        # a block's last unit: stored whole, or as the second partial of a block cut at `start` (stores under masks,
        # no branch: a branch in the loop keeps Triton from pipelining its loads)
        last = kb == k_units - 1
        whole = block * k_units >= start
        y = tl.sum(acc, 0)  # row 0 (the others are zeros)
        tl.store(out_ptr + n, _round_bf16(y).to(tl.bfloat16), mask=last & whole)
        tl.store(partial_ptr + (block * 2 + 1) * BLOCK_N + j, y, mask=last & ~whole)
        acc = tl.where(last, 0.0, acc)
    if end % k_units != 0:  # the last block is cut at `end`: its first partial
        tl.store(partial_ptr + (end // k_units) * 2 * BLOCK_N + j, tl.sum(acc, 0))
    if start % k_units != 0:
        _finish_cut_block(out_ptr, partial_ptr, counter_ptr, start // k_units, BLOCK_N)
    if end % k_units != 0:
        _finish_cut_block(out_ptr, partial_ptr, counter_ptr, end // k_units, BLOCK_N)


@triton.jit
def _finish_cut_block(out_ptr, partial_ptr, counter_ptr, block, BLOCK_N: tl.constexpr):
    """The second of a cut block's two programs to arrive adds their partials in unit order and stores bf16."""
    tl.debug_barrier()  # every thread's stores are issued before the release below
    if tl.atomic_add(counter_ptr + block, 1, sem="acq_rel") == 1:
        j = tl.arange(0, BLOCK_N)
        total = tl.load(partial_ptr + block * 2 * BLOCK_N + j, cache_modifier=".cg")
        total += tl.load(partial_ptr + (block * 2 + 1) * BLOCK_N + j, cache_modifier=".cg")
        tl.store(out_ptr + block * BLOCK_N + j, _round_bf16(total).to(tl.bfloat16))
        tl.atomic_xchg(counter_ptr + block, 0)


def launch(n: int, groups: int, sms: int, **overrides) -> dict:
    """The launch (block_n, block_k, programs, num_warps, num_stages) of an [n, k] weight on `sms` SMs, with
    overrides (sweeps). programs: PROGRAMS_PER_SM an SM, at most one an output block (no block in three shares)."""
    block_n = overrides.get("block_n") or BLOCK_N
    per_sm = overrides.get("programs_per_sm") or PROGRAMS_PER_SM
    return {"block_n": block_n, "block_k": overrides.get("block_k") or BLOCK_K,
            "programs": max(1, min(round(per_sm * sms), n // block_n)),
            "num_warps": overrides.get("num_warps") or NUM_WARPS,
            "num_stages": overrides.get("num_stages") or NUM_STAGES}


def takes(x, weight, groups, block_n: int = BLOCK_N) -> bool:
    """One row whose group outputs a block_n-wide block divides."""
    return x.numel() == x.shape[-1] and (weight.shape[0] // groups) % block_n == 0


def bf16_linear_streamk(x, weight, groups, quantize_x, **overrides):
    """bf16 [..., N] as the reference for one row (`takes`); overrides: `launch`'s (scripts/sweep_linear.py)."""
    (n, k), device = weight.shape, x.device
    settings = launch(n, groups, _num_sms(device) if device.type == "cuda" else 8, **overrides)
    block_n, block_k = settings["block_n"], settings["block_k"]
    if (n // groups) % block_n or block_k < 32 or block_k & (block_k - 1):
        raise ValueError(f"bf16_linear stream-K: block_n={block_n} must divide a group's {n // groups} outputs and "
                         f"block_k={block_k} be a power of two >= 32 (whole FP8 groups)")
    k_units = triton.cdiv(k, block_k)
    out = x.new_empty(n)
    partial = x.new_empty(2 * n, dtype=torch.float32)
    _streamk_kernel[(settings["programs"],)](
        x.contiguous(), weight.contiguous(), out, partial, block_counters(device, n // block_n), n, k, n // groups,
        k_units, k_units * (n // block_n), QUANT_X=quantize_x, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, FP32_DOT=device.type != "cuda", num_warps=settings["num_warps"],
        num_stages=settings["num_stages"], **launch_options(device))
    return out.view(*x.shape[:-1], n)
