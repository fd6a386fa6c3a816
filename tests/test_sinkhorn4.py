"""The seam kernels' Sinkhorn on one [4, 4] tile as 16 scalars (custom_ops/mhc_finish_triton._sinkhorn4) against the
tile version (_sinkhorn_tile) and the model's sinkhorn: the interpreter's values, sm_90 code whose rounds run
without warp shuffles or divisions, and on a GPU the tile's values within a few ulps."""

import re

import pytest
import torch
from hopper import compile_for_hopper
from interp import report, requires_interpreter, run_interpreted

from dsflash_compile.mhc import sinkhorn

triton = pytest.importorskip("triton")
tl = triton.language

from dsflash_compile.custom_ops.mhc_finish_triton import _sinkhorn, _sinkhorn_tile  # noqa: E402

HC_EPS = 1e-6
ITERS = (0, 1, 2, 20)


@triton.jit
def _both_kernel(logits_ptr, tile_ptr, scalars_ptr, hc_eps, iters):
    """One [4, 4] tile a program: _sinkhorn_tile's result and _sinkhorn's (which takes _sinkhorn4 at [4, 4])."""
    i = tl.arange(0, 4)
    at = tl.program_id(0) * 16 + i[:, None] * 4 + i[None, :]
    logits = tl.load(logits_ptr + at)
    tl.store(tile_ptr + at, _sinkhorn_tile(logits, hc_eps, iters))
    tl.store(scalars_ptr + at, _sinkhorn(logits, hc_eps, iters))


def run_both(logits, iters):
    tile, scalars = torch.empty_like(logits), torch.empty_like(logits)
    _both_kernel[(logits.shape[0],)](logits, tile, scalars, HC_EPS, iters)
    return tile, scalars


def logits_for_test(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(64, 4, 4, generator=g) * 3).to(device)


def interpreter_checks():
    """Entry point of the subprocess."""
    logits = logits_for_test()
    for iters in ITERS:
        tile, scalars = run_both(logits, iters)
        want = sinkhorn(logits, iters, HC_EPS)
        report(dict(name=f"iters{iters}", scalars_err=(scalars - want).abs().max().item(),
                    tile_err=(tile - want).abs().max().item()))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_sinkhorn4", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("iters", ITERS)
def test_scalars_match_the_model_as_the_tile_does(interpreted, iters):
    """Within a few fp32 ulps of the model's values (comb < 1), as the tile version (the interpreter sums in
    numpy's order, so neither is bit-exact there)."""
    r = interpreted[f"iters{iters}"]
    assert r["scalars_err"] <= 4e-7 and r["tile_err"] <= 4e-7, r


def test_rounds_compile_for_hopper_without_shuffles():
    """sm_90 code: the tile version's rounds shuffle and divide, the scalars' take 8 reciprocal square roots."""
    import sys

    compiled = compile_for_hopper(sys.modules[__name__], ("_both_kernel", dict(
        logits_ptr="*fp32", tile_ptr="*fp32", scalars_ptr="*fp32", hc_eps="fp32", iters="i32"), {}, 4))
    loops = re.findall(r"Inner Loop Header(.*?)bra", compiled.asm["ptx"], re.S)
    counts = sorted((len(re.findall(r"shfl\.sync", body)), len(re.findall(r"\bdiv\.", body)),
                     len(re.findall(r"\brsqrt\.", body))) for body in loops)
    assert counts == [(0, 0, 8), (4, 2, 0)], counts  # (shuffles, divisions, rsqrt) a round: the scalars', the tile's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scalars_match_the_tile_on_cuda():
    """Within 8 fp32 ulps of the tile's values (comb < 1: ulp <= 2^-24) after 20 rounds, the model's within 1e-6."""
    logits = logits_for_test("cuda")
    for iters in ITERS:
        tile, scalars = run_both(logits, iters)
        print(f"iters {iters}: {(tile != scalars).sum().item()} of {tile.numel()} values differ from the tile's")
        assert (tile - scalars).abs().max().item() <= 8 * 2.0**-24, iters
        assert (scalars - sinkhorn(logits, iters, HC_EPS)).abs().max().item() <= 1e-6, iters
