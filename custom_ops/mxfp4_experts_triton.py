"""Triton kernel of the routed experts' grouped GEMMs: `dsflash::mxfp4_grouped_mm` (see mxfp4_experts.py for
the math) and, with bf16 weights, `dsflash::grouped_mm` (the decode path: few rows per expert). Rows sorted
by expert, tensor-core products accumulated in fp32; MXFP4 weights are dequantized in registers.

No host sync, static grid: a row tile never mixes experts, so expert e needs ceil(rows_e / BLOCK_M) tiles,
and however the P rows fall, the tiles number at most P // BLOCK_M + min(E, P). The grid has that many
tile slots x output blocks; a slot finds its expert by a searchsorted over the cumulative tile counts,
which every program computes from the E offsets (in the kernel: one launch per grouped GEMM, where the
same map in torch took several small kernels per call), and slots past the last tile loop zero times.
Only the selected experts' weights are read: at decode (P = 6 rows per token) every tile is one token's
row against one expert's slice, so the kernel streams each selected expert's weight once, with many
small output blocks to fill the SMs (torch._grouped_mm's CUTLASS kernel at 6 rows: ~2.3 TB/s of the
H200's 4.2 on bf16 weights, 11-30 trace). Each tile dequantizes its expert's weight slice once, so with many
rows per expert (few experts, larger batches) taller tiles pay: MXFP4 launches pick BLOCK_M from the mean
rows per expert (block_m_for).

Dequantization, inline PTX (PTX, the default on CUDA: 1.4-1.5x the Triton conversion on the H200, 11-30,
scripts/sweep_native.py): the bf16 bytes of the 8 E2M1 magnitudes held as tables in registers, looked up by
prmt on 4 nibbles at a time, the sign bits moved in with prmt + lop3, then one bf16x2 multiply by the
power-of-two scale (whose UE8M0 byte is the bf16 exponent field): 2.75 instructions per value in the PTX, ~7
per value in the whole loop on sm_90 (ptxas copies the table constants; masks, x fragments), against ~12 for
the 11-30 kernel (E2M1 -> E4M3 rewrite, E4M3 -> f16 -> f32, fp32 scale, f32 -> bf16, byte shuffles).
The scales of the next K block are loaded one iteration ahead (a byte gather is no cp.async candidate: where
it is used it stalls each iteration for a memory latency). Exact in bf16: the reference's dequantized
values, rounded as torch where they are subnormal; only the fp32 summation order differs from the reference
(F.linear). A scale byte of 0 (2^-127) reads as 0.
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _dot, _e2m1_rows, _ue8m0_bf16, _ue8m0_f32
from .pdl import launch_options, pdl_wait

BLOCK_N = 64
BLOCK_K = 128
NUM_STAGES = 3  # Triton's default, what the MXFP4 launch has run with
# bf16 launches (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by the mean rows per stacked slice (bf16_launch), the
# first entry up to its bound, and so on. Few rows: bf16 weights have twice the bytes per output row of MXFP4, so
# narrower output blocks for as many programs (7 experts, 6 routed and the shared one, x 2304 / 32 = 504 at
# decode). More rows: a row tile reads its expert's weight slice once, so taller tiles read each picked expert
# about once. H200, flash-40l-e8 stacks (8 routed + the shared slice), us per projection against
# torch._grouped_mm (scripts/sweep_experts.py --tall, 12-02 n): 16 tokens (12 rows a slice) w1 / w2 54.6 / ~57
# at 32-row tiles (16-row: 64.7 for w2); 32 tokens 55.2 / 58.6 (torch 84.5 / 85.9); 64 tokens (50 rows a
# slice) 58.1 / 60.0 at 64-row tiles (torch 82.5 / 84.8)
BF16_LAUNCHES = ((8, (16, 32, 128, 4, NUM_STAGES)), (32, (32, 128, 128, 4, 3)), (None, (64, 64, 64, 4, 4)))
PTX = True  # the inline-PTX conversion on CUDA (False: the same values in Triton, the interpreter's path)

# _e2m1_bf16's body. $4: 4 packed bytes (8 nibbles, the even element low); $5-$6: the bytes' bf16 scales.
# Outputs $0-$1: the low nibbles' values (bytes 0-1, 2-3), $2-$3: the high nibbles'. prmt picks bytes by the
# nibbles of its selector's low half (bit 3 would mean sign replication, so the magnitudes are masked): the
# high and low bytes of bf16(|E2M1|) for magnitude codes 0-7 (0, 0.5, 1, 1.5, 2, 3, 4, 6) sit in two register
# pairs. A nibble's sign bit is bit 7 of a byte of w (odd elements) or of w << 4 (even elements).
_E2M1_PTX = tl.constexpr("""{
    .reg .b32 m, mh, v, h0, l0, h1, l1, s, t;
    and.b32 m, $4, 0x77777777; shr.b32 mh, m, 16; shl.b32 v, $4, 4;
    prmt.b32 h0, 0x3F3F3F00, 0x40404040, m; prmt.b32 l0, 0xC0800000, 0xC0804000, m;
    prmt.b32 h1, 0x3F3F3F00, 0x40404040, mh; prmt.b32 l1, 0xC0800000, 0xC0804000, mh;
    prmt.b32 t, l0, h0, 0x6240; prmt.b32 s, v, 0, 0x1404; lop3.b32 t, t, s, 0x80008000, 0xF8;
    mul.rn.bf16x2 $0, t, $5;
    prmt.b32 t, l1, h1, 0x6240; prmt.b32 s, v, 0, 0x3424; lop3.b32 t, t, s, 0x80008000, 0xF8;
    mul.rn.bf16x2 $1, t, $6;
    prmt.b32 t, l0, h0, 0x7351; prmt.b32 s, $4, 0, 0x1404; lop3.b32 t, t, s, 0x80008000, 0xF8;
    mul.rn.bf16x2 $2, t, $5;
    prmt.b32 t, l1, h1, 0x7351; prmt.b32 s, $4, 0, 0x3424; lop3.b32 t, t, s, 0x80008000, 0xF8;
    mul.rn.bf16x2 $3, t, $6;
}""")


@triton.jit
def _e2m1_bf16(packed, exps, PTX: tl.constexpr):
    """Packed E2M1 bytes uint8 [N, P] (even element low) times their 32-input groups' power-of-two scales
    (UE8M0 bytes exps [N, 2P / 32]) -> bf16 [N, 2P], the reference's dequantized values. PTX: the table
    lookup above and a bf16x2 multiply by the scales as bf16 (the byte is bf16's exponent field). Else the
    11-30 conversion (attention_triton._e2m1_rows: E2M1 -> E4M3 rewrite, fp32 scale, one bf16 rounding)."""
    N: tl.constexpr = packed.shape[0]
    P: tl.constexpr = packed.shape[1]
    if PTX:
        scale = _ue8m0_bf16(exps)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (N, P // 16, 16)), (N, P))
        lo, hi = tl.inline_asm_elementwise(asm=_E2M1_PTX, constraints="=r,=r,=r,=r,r,r,r", args=[packed, scale],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return tl.reshape(tl.join(lo, hi), (N, 2 * P))
    scale = _ue8m0_f32(exps)
    return _e2m1_rows(packed, scale[:, :, None], N, 2 * P, 32).to(tl.bfloat16)


@triton.jit
def _tile_of(slot, offsets_ptr, E, P, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """(expert of tile slot `slot`, E past the last tile; the first row of its tile; the end of its rows):
    expert e has ceil(rows_e / BLOCK_M) tiles, numbered in expert order; a slot past the last tile takes the
    u-th block of the rows past the last expert (end P), u counted from the first such slot."""
    ex = tl.arange(0, E_PAD)
    ends = tl.load(offsets_ptr + ex, mask=ex < E, other=0)
    starts = tl.load(offsets_ptr + ex - 1, mask=(ex > 0) & (ex < E), other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    expert = tl.sum(((tile_end <= slot) & (ex < E)).to(tl.int32), 0)  # searchsorted(tile_end, slot, right=True)
    mine = ex == expert
    first_slot = tl.where(expert < E, tl.sum(tl.where(mine, tile_end - tiles, 0), 0), tl.sum(tiles, 0))
    start = tl.where(expert < E, tl.sum(tl.where(mine, starts, 0), 0), tl.max(ends, 0))
    end = tl.where(expert < E, tl.sum(tl.where(mine, ends, 0), 0), P)
    return expert, start + (slot - first_slot) * BLOCK_M, end


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, s_ptr, offsets_ptr, out_ptr, P, E, N, K, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr, MXFP4: tl.constexpr,
                    FP32_DOT: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr):
    """MXFP4: w packed E2M1 [E, N, K/2] with UE8M0 scales s [E, N, K/32]; else w bf16 [E, N, K] (s unused).
    out [P, N]: the slots past the last tile write zeros into the rows past the last expert (u-th such slot:
    u-th block of those rows), so the output needs no zero fill beforehand."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    slot, pid_n = tl.program_id(0), tl.program_id(1)
    expert, first_row, row_end = _tile_of(slot, offsets_ptr, E, P, BLOCK_M, E_PAD)
    used = expert < E
    e = tl.minimum(expert, E - 1)  # keeps every address in bounds
    m = first_row + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = m < row_end, n < N
    x_rows = x_ptr + m[:, None].to(tl.int64) * K
    if MXFP4:
        w_rows = w_ptr + (e.to(tl.int64) * N + n[:, None]) * (K // 2)
    else:
        w_rows = w_ptr + (e.to(tl.int64) * N + n[:, None]) * K
    s_rows = s_ptr + (e.to(tl.int64) * N + n[:, None]) * tl.cdiv(K, 32)
    blocks = tl.where(used, tl.cdiv(K, BLOCK_K), 0)  # a tail slot stores its zero accumulator
    kt = tl.arange(0, BLOCK_K // 32)
    exps = tl.load(s_rows + kt[None, :], mask=n_in[:, None] & (kt * 32 < K)[None, :], other=0) if MXFP4 else 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(blocks):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=m_in[:, None] & (k < K)[None, :], other=0.0)
        if MXFP4:
            kp = i * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_rows + kp[None, :], mask=n_in[:, None] & (kp < K // 2)[None, :], other=0)
            # the next block's scales now, used one iteration later (the last one reloads itself)
            kt = tl.minimum(i + 1, blocks - 1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
            next_exps = tl.load(s_rows + kt[None, :], mask=n_in[:, None] & (kt * 32 < K)[None, :], other=0)
            w = _e2m1_bf16(packed, exps, PTX)
            exps = next_exps
        else:
            w = tl.load(w_rows + k[None, :], mask=n_in[:, None] & (k < K)[None, :], other=0.0)
        acc += _dot(x, tl.trans(w), FP32_DOT)
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(tl.bfloat16), mask=m_in[:, None] & n_in[None, :])


def block_m_for(rows: int, experts: int) -> int:
    """MXFP4 BLOCK_M for `rows` over `experts` (shapes only: no host sync): the smallest of 16 / 32 / 64 not
    below rows // experts, 64 above. Taller tiles dequantize each weight slice for more rows, but at a few
    rows per expert they are mostly padding. Timed only at 6 and 48 rows per expert: the 32 band (17-32) and
    prefill's hundreds of rows per expert follow the trend, untimed. H200, flash-40l-e8 (8 experts, top-6), 11-30 e
    (native-sweep-experts-e8-2026-11-30-e.log), us at BLOCK_M 16 / 32 / 64: 6 rows per expert (8 tokens) w1
    51.3 / 79.8 / 100.8, w2 41.1 / 63.3 / 73.0; 48 rows (64 tokens) w1 126.4 / 128.1 / 101.5, w2 122.7 /
    105.1 / 77.6."""
    return min(max(triton.next_power_of_2(rows // experts), 16), 64)


def bf16_launch(rows: int, experts: int) -> dict:
    """bf16 launch keywords for `rows` over `experts` stacked slices (shapes only: no host sync), from
    BF16_LAUNCHES by the mean rows per slice."""
    per_slice = rows // experts
    for bound, (block_m, block_n, block_k, warps, stages) in BF16_LAUNCHES:
        if bound is None or per_slice <= bound:
            return dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
    raise AssertionError("BF16_LAUNCHES ends with an unbounded entry")


def grouped_mm_triton(x, weight, scale, offsets, block_m=None, block_n=None, block_k=None, num_warps=None,
                      num_stages=None, ptx=None, out=None):
    """bf16 [P, N] as the reference (rows past offsets[-1] are zero). scale None: bf16 weight [E, N, K]; else
    MXFP4 weight and scale (mxfp4_experts.py). Block sizes, warps and pipeline stages (None: the format's
    default: for MXFP4 BLOCK_M from block_m_for, 4 warps, NUM_STAGES; for bf16 bf16_launch's) and the MXFP4
    conversion (ptx None: the module's PTX flag, on CUDA only) for sweeps; out: the bf16 [P, N] to write
    (default: a new one; every element is written)."""
    mxfp4 = scale is not None
    rows, k = x.shape
    experts, n, _ = weight.shape
    if mxfp4:
        default = dict(block_m=block_m_for(rows, experts), block_n=BLOCK_N, block_k=BLOCK_K, num_warps=4,
                       num_stages=NUM_STAGES)
    else:
        default = bf16_launch(rows, experts)
    block_m, block_n, block_k = (block_m or default["block_m"], block_n or default["block_n"],
                                 block_k or default["block_k"])
    num_warps, num_stages = num_warps or default["num_warps"], num_stages or default["num_stages"]
    out = x.new_empty(rows, n) if out is None else out
    if rows == 0:
        return out
    weight = weight.contiguous()
    w, s = (weight.view(torch.uint8), scale.contiguous().view(torch.uint8)) if mxfp4 else (weight, weight)
    # the most tiles any routing of the rows needs, + 1: then the slots past the last tile always cover the rows
    # past the last expert (tiles <= (rows here + (block_m - 1) x nonempty experts) / block_m)
    slots = rows // block_m + min(experts, rows) + 1
    _grouped_kernel[(slots, triton.cdiv(n, block_n))](
        x.contiguous(), w, s, offsets, out, rows, experts, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        E_PAD=triton.next_power_of_2(experts), MXFP4=mxfp4, FP32_DOT=x.device.type != "cuda",
        PTX=x.device.type == "cuda" and PTX if ptx is None else ptx, num_warps=num_warps, num_stages=num_stages,
        **launch_options(x.device))
    return out
