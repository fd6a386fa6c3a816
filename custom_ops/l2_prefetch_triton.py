"""Triton kernel of `dsflash::l2_prefetch_` (see l2_prefetch.py): bulk prefetches of a tensor's bytes into L2.

Grid: one program per PER_PROGRAM chunks; each thread issues one sm_90 `cp.async.bulk.prefetch.L2` of up to
CHUNK bytes. The instruction hands the range to the SM's copy engine and returns: no registers hold the data
and there is no completion to wait for, so the program exits at once and the bytes keep arriving in L2 while
the kernels after it run. Chunk c lies in piece c // chunks_per_piece, at offset (c % chunks_per_piece) * CHUNK
of the piece's first `take` bytes.
"""

import triton
import triton.language as tl

CHUNK = 16384  # bytes per instruction
PER_PROGRAM = 32  # instructions per program: one per thread of a warp


@triton.jit
def _l2_prefetch_kernel(base, piece_bytes, take, chunks_per_piece, chunks, CHUNK: tl.constexpr,
                        PER_PROGRAM: tl.constexpr):
    c = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    j = c % chunks_per_piece
    start = j.to(tl.int64) * CHUNK
    size = tl.where(c < chunks, tl.minimum(take - start, CHUNK), 0).to(tl.int32)
    ptrs = base + (c // chunks_per_piece).to(tl.int64) * piece_bytes + start
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch_triton(flat_bytes, piece_bytes: int, take: int, pieces: int, chunk: int = CHUNK,
                       per_program: int = PER_PROGRAM) -> None:
    """Prefetch the first `take` bytes of each of `pieces` pieces of `piece_bytes` bytes of `flat_bytes` (a
    contiguous uint8 tensor; offsets and sizes multiples of 16, as the instruction needs)."""
    chunks_per_piece = triton.cdiv(take, chunk)
    chunks = pieces * chunks_per_piece
    grid = (triton.cdiv(chunks, per_program),)
    _l2_prefetch_kernel[grid](flat_bytes, piece_bytes, take, chunks_per_piece, chunks, CHUNK=chunk,
                              PER_PROGRAM=per_program, num_warps=max(1, per_program // 32))
