"""`dsflash::fp32_gemv` (custom_ops/fp32_gemv.py): one row of an fp32 projection on bf16_gemv's kernel.

Under the interpreter against the reference (bit for bit on data whose sums are exact in fp32, within fp32 rounding
on random data), bf16 and fp32 rows, split over K or in whole rows, K not a multiple of the tile, called twice (the
split counters left at zero); compiled for sm_90 without spills at the compressors' launch; opcheck and errors;
layers.Linear's choice of it and the compressor's fused wkv + wgate; on a GPU at the release size, in a CUDA
graph."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from torch.fx.experimental.proxy_tensor import make_fx

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile import preset_config
from dsflash_compile.attention import Compressor
from dsflash_compile.custom_ops import bf16_linear_gemv_triton as gemv
from dsflash_compile.custom_ops.fp32_gemv import fp32_gemv_reference
from dsflash_compile.layers import Linear

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (K, N, x dtype, exact data, launch overrides)
CASES = {
    "splits_bf16_x": (2048, 32, torch.bfloat16, True, {}),  # the default fp32 tile: 512 columns, 4 splits
    "ragged_k_fp32_x": (1280, 16, torch.float32, True, {}),  # the last split 256 wide
    "whole_rows": (1536, 48, torch.bfloat16, True, dict(block_n=4, k_chunks=3)),
    "random": (2048, 64, torch.bfloat16, False, {}),
}


def case_inputs(k, n, dtype, exact, seed=0, device="cpu"):
    """Exact data: values on a coarse grid, so that every sum is exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        x, w = torch.randint(-3, 4, (1, k), generator=g) / 2, torch.randint(-3, 4, (n, k), generator=g) / 16
    else:
        x, w = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g) / 16
    return x.to(dtype).to(device), w.float().to(device)


def interpreter_checks():
    """Entry point of the subprocess: every case's kernel against the reference."""
    for name, (k, n, dtype, _, launch) in CASES.items():
        x, w = case_inputs(k, n, dtype, CASES[name][3])
        got = gemv.bf16_linear_gemv(x, w, 1, False, **launch)
        want = fp32_gemv_reference(x, w)
        again = gemv.bf16_linear_gemv(x, w, 1, False, **launch)
        report(dict(name=name, same=torch.equal(got, want), again=torch.equal(again, got), dtype=str(got.dtype),
                    shape=list(got.shape), err=((got - want).abs().max() / want.abs().max()).item()))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_fp32_gemv", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    """fp32 sums out, unrounded: the reference's bits where every sum is exact, else within fp32 rounding."""
    result, (_, n, _, exact, _) = interpreted[name], CASES[name]
    assert result["shape"] == [1, n] and result["dtype"] == "torch.float32" and result["again"], result
    assert result["same"] if exact else result["err"] <= 1e-6, result


def test_opcheck_and_errors():
    x, w = case_inputs(256, 32, torch.bfloat16, False)
    torch.library.opcheck(torch.ops.dsflash.fp32_gemv.default, (x, w))
    assert torch.equal(torch.ops.dsflash.fp32_gemv(x, w), torch.nn.functional.linear(x.float(), w))
    with pytest.raises(TypeError, match="weight must be fp32"):
        torch.ops.dsflash.fp32_gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match="one row only"):
        torch.ops.dsflash.fp32_gemv(x.expand(2, -1), w)
    with pytest.raises(ValueError, match="must end in weight"):
        torch.ops.dsflash.fp32_gemv(x[:, :128], w)


def test_fp32_linear_takes_it_for_one_row_when_set():
    """layers.Linear with an fp32 weight and gemv set: one row (bf16 or fp32) runs fp32_gemv, more rows F.linear."""
    torch.manual_seed(0)
    linear = Linear(64, 32, dtype=torch.float32)
    linear.gemv = True
    for x in (torch.randn(1, 64).bfloat16(), torch.randn(1, 1, 64), torch.randn(2, 64).bfloat16()):
        ops = {node.target for node in make_fx(linear)(x).graph.nodes if node.op == "call_function"}
        assert (torch.ops.dsflash.fp32_gemv.default in ops) == (x.numel() == 64), (x.shape, ops)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x.float(), linear.weight), rtol=0, atol=0)


def test_compressor_fuses_wkv_and_wgate():
    """Compressor.fuse_projections: one fp32 [2d, K] projection whose halves are wkv's and wgate's tensors (views),
    kept across a second call and a move, dropped with fuse=False; ratio 1 has nothing to fuse."""
    config = preset_config("tiny").text_config
    compressor = Compressor(config, 4)
    compressor.fuse_projections()
    fused = compressor.wkv_gate
    assert fused.weight.dtype == torch.float32 and fused.weight.shape == (2 * config.head_dim, config.hidden_size)
    assert torch.equal(fused.weight, torch.cat([compressor.wkv.weight, compressor.wgate.weight]))
    assert compressor.wkv.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    compressor.fuse_projections()
    assert compressor.wkv_gate is fused
    compressor.to(torch.float32)
    assert compressor.wgate.weight.untyped_storage().data_ptr() == compressor.wkv_gate.weight.untyped_storage().data_ptr()
    compressor.fuse_projections(False)
    assert compressor.wkv_gate is None
    one = Compressor(config, 1)
    one.fuse_projections()
    assert one.wkv_gate is None


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("whole_rows", [False, True])
def test_compiles_for_hopper_without_spills(whole_rows, early):
    """The compressors' fused [1024, 4096] fp32 weight at its default launch (512-column tiles, K split) and at
    whole rows of 4 outputs, without spills on sm_90; also reading and summing before the PDL wait (EARLY: its early
    launch is the default one, a K loop would take 16 tiles)."""
    launch = gemv.launch(1024, 4096, 1, 132, itemsize=4)
    assert launch == dict(block_n=16, block_k=512, num_warps=4, k_chunks=1)
    assert gemv.early_launch(1024, 4096, 1, 132, itemsize=4) == dict(launch, loop=False)
    if whole_rows:
        launch = dict(block_n=4, block_k=512, num_warps=8, k_chunks=8)
    args = dict(x_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32", partial_ptr="*fp32", counter_ptr="*i32", N="i32",
                K="i32", n_per_group="i32")
    constexprs = dict(QUANT_X=False, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"],
                      K_CHUNKS=launch["k_chunks"], NORM=False, HEAD=0, TAIL=0, EARLY=early, LOOP=False, SCALED=False)
    check_compiles_for_hopper(gemv, ("_gemv_kernel", args, constexprs, launch["num_warps"]),
                              divisible_by_16=("x_ptr", "w_ptr", "K"))


# ----------------------------------------------------------------------------------------------- CUDA

@requires_cuda
def test_release_size_on_cuda():
    """The compressors' fused wkv + wgate (1024 x 4096 fp32, a bf16 row): within fp32 rounding of the reference
    (cuBLAS), the op on this kernel, and replayed in a CUDA graph on a new row."""
    x, w = case_inputs(4096, 1024, torch.bfloat16, False, device="cuda")
    assert gemv.fits(x, w, 1)
    got = torch.ops.dsflash.fp32_gemv(x, w)
    want = fp32_gemv_reference(x, w)
    assert got.dtype == torch.float32 and ((got - want).abs().max() / want.abs().max()).item() <= 1e-6
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dsflash.fp32_gemv(x, w)
    x.copy_(case_inputs(4096, 1024, torch.bfloat16, False, seed=1, device="cuda")[0])
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, torch.ops.dsflash.fp32_gemv(x, w))
