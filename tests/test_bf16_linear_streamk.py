"""The one-row stream-K kernel of `dsflash::bf16_linear` (custom_ops/bf16_linear_streamk_triton.py).

Under the interpreter against the reference (bit for bit on data whose sums are exact in fp32): blocks whole in a
program and blocks cut between two, K not a multiple of the unit, grouped, called twice (the cut blocks' counters
left at zero); its loop pipelined and without spills on sm_90; the launch's program count; on a GPU at the
release sizes, in a CUDA graph."""

import re

import pytest
import torch
from hopper import check_compiles_for_hopper, compile_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_bf16_linear import RELEASE, case_inputs

from dsflash_compile.custom_ops import bf16_linear_streamk_triton as streamk
from dsflash_compile.custom_ops.bf16_linear import bf16_linear_reference

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (K per group, N, groups, quantize_x, exact data, launch overrides); the interpreter has 8 "SMs"
CASES = {
    "cut_blocks": (256, 96, 1, True, True, dict(block_n=16, block_k=64, programs_per_sm=0.5)),  # 6 blocks, 4 programs
    "whole_blocks": (256, 64, 1, True, True, dict(block_n=16, block_k=64, programs_per_sm=0.5)),  # 4 and 4
    "ragged_k": (224, 96, 1, True, True, dict(block_n=32, block_k=64, programs_per_sm=0.25)),  # a 32-wide last unit
    "grouped": (192, 64, 2, False, True, dict(block_n=16, block_k=32, programs_per_sm=0.375)),
    "one_program_a_block": (128, 128, 1, True, True, dict(block_n=16, block_k=32, programs_per_sm=1)),
    "random_data": (1024, 96, 1, True, False, dict(block_n=32, block_k=128, programs_per_sm=0.25)),
}


def interpreter_checks():
    """Entry point of the subprocess: every case's kernel against the reference."""
    for name, (k, n, groups, quantize_x, exact, launch) in CASES.items():
        x, w = case_inputs((1,), k, n, groups, exact)
        got = streamk.bf16_linear_streamk(x, w, groups, quantize_x, **launch)
        want = bf16_linear_reference(x, w, groups, quantize_x)
        again = streamk.bf16_linear_streamk(x, w, groups, quantize_x, **launch)
        counters = streamk.block_counters(x.device, n // launch["block_n"])
        report(dict(name=name, same=torch.equal(got, want), again=torch.equal(again, got), shape=list(got.shape),
                    err=((got - want).abs().max() / want.abs().max()).item(), zeroed=int(counters.abs().sum())))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_bf16_linear_streamk", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    result, (_, n, _, _, exact, _) = interpreted[name], CASES[name]
    assert result["shape"] == [1, n] and result["again"] and result["zeroed"] == 0, result
    if exact:
        assert result["same"], result
    else:  # another summation order can move a bf16 rounding
        assert result["err"] <= 1e-2, result


def test_launch_keeps_a_block_in_at_most_two_programs():
    """At most one program an output block (so a program's share holds a block's units), else PROGRAMS_PER_SM."""
    assert streamk.launch(5120, 1, 132, block_n=32)["programs"] == 132 * streamk.PROGRAMS_PER_SM
    assert streamk.launch(5120, 1, 132, block_n=32, programs_per_sm=2)["programs"] == 160
    assert streamk.launch(64, 1, 132, block_n=16)["programs"] == 4


def test_rejects_launches_it_cannot_run():
    x, w = case_inputs((1,), 64, 48, 1, True)
    with pytest.raises(ValueError, match="block_n=32 must divide a group's 48 outputs"):
        streamk.bf16_linear_streamk(x, w, 1, True, block_n=32)
    with pytest.raises(ValueError, match="block_k=48 be a power of two"):
        streamk.bf16_linear_streamk(x, w, 1, True, block_n=16, block_k=48)


ARGS = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32", N="i32",
            K="i32", n_per_group="i32", k_units="i32", units="i32")


@pytest.mark.parametrize("quantize", [True, False])
def test_compiles_for_hopper_pipelined_without_spills(quantize):
    """The default launch on sm_90: no spills, and the weight's loads software-pipelined (cp.async): stores under
    masks rather than a branch in the loop, which Triton does not pipeline."""
    launch = streamk.launch(5120, 1, 132)
    constexprs = dict(QUANT_X=quantize, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"], EVEN_K=True,
                      FP32_DOT=False)
    spec = ("_streamk_kernel", ARGS, constexprs, launch["num_warps"])
    check_compiles_for_hopper(streamk, spec, divisible_by_16=("x_ptr", "w_ptr", "K"))
    ptx = compile_for_hopper(streamk, spec, divisible_by_16=("x_ptr", "w_ptr", "K")).asm["ptx"]
    assert re.search(r"cp\.async\.cg", ptx), "the weight's loads are not pipelined"


# ----------------------------------------------------------------------------------------------- CUDA

@requires_cuda
@pytest.mark.parametrize("name", ["wq_b", "wo_a", "wo_b"])
def test_release_sizes_on_cuda(name):
    """Against the reference (cuBLAS: another summation order), the same bits on a second call, and replayed in a
    CUDA graph on new x."""
    k, n, groups, quantize = RELEASE[name]
    x, w = case_inputs((1,), k, n, groups, False, device="cuda")
    got = streamk.bf16_linear_streamk(x, w, groups, quantize)
    want = bf16_linear_reference(x, w, groups, quantize)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-2
    assert torch.equal(streamk.bf16_linear_streamk(x, w, groups, quantize), got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = streamk.bf16_linear_streamk(x, w, groups, quantize)
    x.copy_(case_inputs((1,), k, n, groups, False, seed=1, device="cuda")[0])
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, streamk.bf16_linear_streamk(x, w, groups, quantize))
