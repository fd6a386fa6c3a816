"""custom_ops/bf16_bits.py: the kernels' fp32 <-> bf16 conversions in integer arithmetic equal PyTorch's casts bit for
bit (NaN where PyTorch has NaN) over random bit patterns and the edge cases: ties, subnormals, the largest finite
values (which round to inf), inf, and NaNs with every payload the GPU makes (0x7FFFFFFF, its NaN results, was
rounded to -0 before 12-05)."""

import pytest
import torch
import triton
import triton.language as tl
from interp import report, requires_interpreter, run_interpreted

from dsflash_compile.custom_ops.bf16_bits import _bf16_as_f32, _f32_to_bf16, _round_bf16

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
EDGES = [0, 0x80000000, 1, 0x7FFF, 0x8000, 0x8001, 0x18000, 0x807FFFFF, 0x00800000, 0x3F808000, 0x3F818000,
         0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000,
         0x7FFFFFFF, 0xFFFFFFFF, 0xFFC00000, 0x7FBFFFFF]


@triton.jit
def _convert_kernel(x_ptr, rounded_ptr, bf16_ptr, back_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    v = tl.load(x_ptr + i)
    tl.store(rounded_ptr + i, _round_bf16(v))
    b = _f32_to_bf16(v)
    tl.store(bf16_ptr + i, b)
    tl.store(back_ptr + i, _bf16_as_f32(b))


def patterns() -> torch.Tensor:
    bits = torch.randint(-2**31, 2**31, (4096 - len(EDGES),), generator=torch.Generator().manual_seed(0))
    return torch.cat([torch.tensor(EDGES, dtype=torch.int64), bits]).to(torch.uint32).view(torch.int32).view(
        torch.float32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN where the other has NaN (payloads aside)."""
    nan = a.isnan()
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(bits), b[~nan].view(bits)))


def checks(device: str) -> dict:
    x = patterns().to(device)
    rounded, back = torch.empty_like(x), torch.empty_like(x)
    bf16 = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _convert_kernel[(1,)](x, rounded, bf16, back, N=x.numel())
    want = x.cpu().to(torch.bfloat16)
    return dict(bf16=same(bf16.cpu(), want), rounded=same(rounded.cpu(), want.float()),
                back=same(back.cpu(), want.float()))


def interpreter_checks():
    """Entry point of the subprocess."""
    report(dict(name="interpreter", **checks("cpu")))


@requires_interpreter
def test_conversions_equal_torchs_casts_under_the_interpreter():
    assert run_interpreted("test_bf16_bits", "interpreter_checks")["interpreter"] == dict(
        name="interpreter", bf16=True, rounded=True, back=True)


@requires_cuda
def test_conversions_equal_torchs_casts_on_cuda():
    assert checks("cuda") == dict(bf16=True, rounded=True, back=True)
