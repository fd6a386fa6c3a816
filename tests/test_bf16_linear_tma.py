"""The one-row TMA kernel of `dsflash::bf16_linear` (custom_ops/bf16_linear_tma_triton.py).

Under the interpreter against the reference (bit for bit on data whose sums are exact in fp32): K not a multiple
of the tile, grouped, with and without the FP8 of x; which projections take it; compiled for sm_90 with TMA
loads and no spills; on a GPU at the release's sizes, through the op and in a CUDA graph."""

import re

import pytest
import torch
from hopper import check_compiles_for_hopper, compile_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_bf16_linear import RELEASE, case_inputs

from dsflash_compile.custom_ops import bf16_linear_tma_triton as tma
from dsflash_compile.custom_ops.bf16_linear import bf16_linear_reference

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (K per group, N, groups, quantize_x, exact data, launch)
CASES = {
    "quantized": (512, 64, 1, True, True, dict(block_n=32, block_k=128, num_stages=2)),
    "ragged_k": (224, 96, 1, True, True, dict(block_n=32, block_k=64, num_stages=3)),  # a last tile 32 wide
    "grouped": (256, 64, 4, False, True, dict(block_n=16, block_k=64, num_stages=2)),
    "random_data": (1024, 64, 1, True, False, dict(block_n=64, block_k=256, num_stages=5)),
}


def interpreter_checks():
    """Entry point of the subprocess: every case's kernel against the reference."""
    for name, (k, n, groups, quantize_x, exact, launch) in CASES.items():
        x, w = case_inputs((1,), k, n, groups, exact)
        got = tma.bf16_linear_tma(x, w, groups, quantize_x, **launch)
        want = bf16_linear_reference(x, w, groups, quantize_x)
        report(dict(name=name, same=torch.equal(got, want), shape=list(got.shape),
                    err=((got - want).abs().max() / want.abs().max()).item()))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_bf16_linear_tma", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    result, (_, n, _, _, exact, _) = interpreted[name], CASES[name]
    assert result["shape"] == [1, n], result
    if exact:
        assert result["same"], result
    else:  # another summation order can move a bf16 rounding
        assert result["err"] <= 1e-2, result


def test_which_projections_take_it():
    """Of the release's projections one row of wq_b, wo_a and wo_b (84 / 67 / 84 MB), not more rows, not the
    smaller ones (wq_a+wkv 18 MB, the indexer's wq_b 10 MB)."""
    def takes(name, rows=1):
        k, n, groups, _ = RELEASE[name]
        x, w = torch.zeros(rows, groups * k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.bfloat16)
        return tma.takes(x, w, groups)

    assert [name for name in RELEASE if takes(name)] == ["wq_b", "wo_a", "wo_b"]
    assert not takes("wo_b", rows=2)
    x, w = torch.zeros(1, 8200, dtype=torch.bfloat16), torch.zeros(4096, 8200, dtype=torch.bfloat16)
    assert tma.takes(x, w, 1) and not tma.takes(x[:, :8196], w[:, :8196].contiguous(), 1)  # rows of whole 16 bytes
    assert not tma.takes(x, w[:64], 1)  # 1 MB


def test_launch_by_row_length():
    """[64, 256] x 5 stages from LONG_K (wo_a, wo_b), [128, 128] x 3 below (wq_b); the L2 prefetch from
    PREFETCH_MIN_K (wo_b); overrides win."""
    long = dict(block_n=64, block_k=256, num_stages=5, num_warps=4)
    assert tma.launch(8192) == dict(long, prefetch_stages=tma.PREFETCH_STAGES)  # wo_b: PREFETCH_MIN_K
    assert tma.launch(4096) == dict(long, prefetch_stages=0)
    assert tma.launch(1280) == dict(block_n=128, block_k=128, num_stages=3, num_warps=4, prefetch_stages=0)
    assert tma.launch(1280, num_stages=2)["num_stages"] == 2


def test_rejects_launches_it_cannot_run():
    x, w = case_inputs((1,), 64, 48, 1, True)
    with pytest.raises(ValueError, match="block_n=32 must divide a group's 48 outputs"):
        tma.bf16_linear_tma(x, w, 1, True, block_n=32)
    with pytest.raises(ValueError, match="block_k=48 be a power of two"):
        tma.bf16_linear_tma(x, w, 1, True, block_n=16, block_k=48)


@pytest.mark.parametrize("k, quantize, prefetch_k, pairs", [(8192, True, 0, 0), (8192, False, 0, 0),
                                                          (8192, True, 1280, 0), (1280, True, 0, 32)])
def test_compiles_for_hopper_with_tma_without_spills(k, quantize, prefetch_k, pairs):
    """The default launches on sm_90 (wq_b's with the release's 32 RoPE pairs of 512-wide heads in its epilogue):
    no spills, the weight's tiles by TMA (cp.async.bulk.tensor); with PREFETCH_K the L2 prefetch of the weight
    comes before the PDL wait, every other global access after it."""
    launch = tma.launch(k)
    args = dict(x_ptr="*bf16", w_ptr="*bf16", w_desc=f"tensordesc<bf16[{launch['block_n']},{launch['block_k']}]>",
                out_ptr="*bf16", rot_ptr="*fp32", norm_w_ptr="*bf16", K="i32", n_per_group="i32", head_dim="i32",
                eps="fp32")
    spec = ("_tma_gemv_kernel", args, dict(QUANT_X=quantize, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"],
                                           NORM_ROW=0, PAIRS=pairs, PREFETCH_K=prefetch_k, FP32_DOT=False),
            launch["num_warps"], launch["num_stages"])
    aligned = ("x_ptr", "w_ptr", "out_ptr", "rot_ptr", "K", "n_per_group", "head_dim")  # as launched
    check_compiles_for_hopper(tma, spec, divisible_by_16=aligned)
    ptx = compile_for_hopper(tma, spec, divisible_by_16=aligned).asm["ptx"]
    assert re.search(r"cp\.async\.bulk\.tensor", ptx), "the weight's tiles do not arrive by TMA"
    wait = ptx.index("griddepcontrol.wait")
    assert ("cp.async.bulk.prefetch.L2" in ptx[:wait]) == (prefetch_k > 0)
    assert not re.search(r"(ld|st)\.global|cp\.async\.bulk\.tensor", ptx[:wait])


# ----------------------------------------------------------------------------------------------- CUDA

@requires_cuda
@pytest.mark.parametrize("name", ["wo_b", "wo_a", "wq_b"])
def test_release_sizes_on_cuda(name):
    """Against the reference (cuBLAS: another summation order), through the op (this kernel: the same bits),
    replayed in a CUDA graph on new x."""
    k, n, groups, quantize = RELEASE[name]
    x, w = case_inputs((1,), k, n, groups, False, device="cuda")
    got = tma.bf16_linear_tma(x, w, groups, quantize)
    want = bf16_linear_reference(x, w, groups, quantize)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-2
    assert torch.equal(tma.bf16_linear_tma(x, w, groups, quantize), got)
    assert torch.equal(tma.bf16_linear_tma(x, w, groups, quantize, prefetch_stages=2), got)
    assert torch.equal(torch.ops.dsflash.bf16_linear(x, w, groups, quantize), got)
    assert torch.equal(torch.ops.dsflash.bf16_gemv(x, w, groups, quantize), got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tma.bf16_linear_tma(x, w, groups, quantize)
    x.copy_(case_inputs((1,), k, n, groups, False, seed=1, device="cuda")[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, tma.bf16_linear_tma(x, w, groups, quantize))
