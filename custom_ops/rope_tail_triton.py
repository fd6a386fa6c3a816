"""Triton kernel of `dsflash::rope_` (see rope_tail.py for the math): one program per (token, block of heads).

A program loads its heads' trailing pairs (one contiguous run a head, split into even and odd values in registers)
and the token's (cos, sin), and writes the rotated pairs back in place; the other columns are never read. The
rotated values round to bf16 in integer arithmetic (_round_bf16), which the interpreter runs as the GPU does.
"""

import triton
import triton.language as tl

from .bf16_bits import _round_bf16
from .pdl import launch_options, pdl_wait

HEADS_PER_PROGRAM = 16  # 64 heads x 32 pairs at the release shape: 4 programs a token, 1024 values each


@triton.jit
def _rope_tail_kernel(x_ptr, rot_ptr, H, D, HEADS: tl.constexpr, PAIRS: tl.constexpr, PDL: tl.constexpr):
    """x [N, H, D] contiguous (tokens, heads), rot [N, PAIRS, 2]."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    live = (h < H)[:, None]
    tail = x_ptr + (tok * H + h[:, None]) * D + (D - 2 * PAIRS) + tl.arange(0, 2 * PAIRS)[None, :]
    # each head's tail as one contiguous run, split into its pairs' (even, odd) values in registers
    even, odd = tl.split(tl.reshape(tl.load(tail, mask=live, other=0.0).to(tl.float32), (HEADS, PAIRS, 2)))
    cos, sin = tl.split(tl.reshape(tl.load(rot_ptr + tok * 2 * PAIRS + tl.arange(0, 2 * PAIRS)), (1, PAIRS, 2)))
    rotated = tl.join(_round_bf16(even * cos - odd * sin), _round_bf16(even * sin + odd * cos))
    tl.store(tail, tl.reshape(rotated, (HEADS, 2 * PAIRS)).to(tl.bfloat16), mask=live)


def kernel_fits(x, rot) -> bool:
    """What the kernel takes of the op's checked inputs (else the op runs its reference): contiguous x, a power
    of two of pairs."""
    pairs = rot.shape[-2]
    return x.is_contiguous() and pairs & (pairs - 1) == 0


def rope_tail_triton_(x, rot):
    """Rotates x's trailing pairs in place, as the reference."""
    pairs = rot.shape[-2]
    heads = x.shape[-2] if x.dim() == rot.dim() else 1  # [..., T, heads, D] or [..., T, D]
    tokens = rot.numel() // (2 * pairs)
    if tokens:
        block = min(HEADS_PER_PROGRAM, triton.next_power_of_2(heads))
        _rope_tail_kernel[(tokens, triton.cdiv(heads, block))](x, rot.contiguous(), heads, x.shape[-1], HEADS=block,
                                                               PAIRS=pairs, num_warps=4, **launch_options(x.device))
