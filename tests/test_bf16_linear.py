"""`dsflash::bf16_linear` (custom_ops/bf16_linear.py): a few-row bf16 projection, its input's FP8 in the launch.

The Triton kernel under the interpreter against the reference (bit for bit on data whose sums are exact in
fp32, so only the kernel's rounding points are tested; within a GEMM's summation order on random data), split
or not; compiled for sm_90 without spills; opcheck; its errors; QuantLinear's few-row path against its plain
path; and on a GPU at the release's sizes and inside a CUDA graph."""

import pytest
import torch
from dsflash_compile.custom_ops.bf16_linear import bf16_linear_reference
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.compiled import CompileOptions
from dsflash_compile.layers import QuantLinear
from dsflash_compile.quant import fp8_qdq

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (rows (leading shape), K per group, N, groups, quantize_x, exact data, launch overrides)
CASES = {
    "one_row": ((1,), 256, 64, 1, True, True, {"splits": 1}),
    "one_row_split": ((1,), 512, 64, 1, True, True, {"splits": 3}),  # 4 K blocks over 3 splits: 2 + 2
    "grouped": ((3,), 128, 64, 2, False, True, {"block_n": 16, "splits": 1}),
    "grouped_one_row": ((1,), 128, 64, 2, True, True, {"block_n": 16, "splits": 2}),
    "grouped_split": ((2, 3), 256, 96, 3, False, True, {"block_k": 64, "splits": 4}),
    "ragged_k": ((5,), 160, 32, 1, True, True, {"block_k": 64, "splits": 2}),  # K not a multiple of the block
    "row_tile_64": ((40,), 256, 32, 1, True, True, {"splits": 2}),
    "row_tile_64_tall_launch": ((40,), 256, 32, 1, False, True, {}),  # launch(): 128-wide K blocks, 4 stages
    "random_data": ((7,), 512, 64, 1, True, False, {"splits": 2}),
}


def case_inputs(shape, k, n, groups, exact, seed=0, device="cpu"):
    """Exact data: values on a coarse grid, so that every sum is exact in fp32."""
    g = torch.Generator().manual_seed(seed)

    def values(*size, div):
        if exact:
            return (torch.randint(-3, 4, size, generator=g) / div).bfloat16()
        return (torch.randn(size, generator=g) / div).bfloat16()

    return values(*shape, groups * k, div=2).to(device), values(n, k, div=16).to(device)


def interpreter_checks():
    """Entry point of the subprocess: every case's kernel run against the reference."""
    from dsflash_compile.custom_ops.bf16_linear_triton import bf16_linear_triton

    for name, (shape, k, n, groups, quantize_x, exact, launch) in CASES.items():
        x, w = case_inputs(shape, k, n, groups, exact)
        got = bf16_linear_triton(x, w, groups, quantize_x, **launch)
        want = bf16_linear_reference(x, w, groups, quantize_x)
        report(dict(name=name, same=torch.equal(got, want), shape=list(got.shape),
                    err=((got - want).abs().max() / want.abs().max()).item()))
    x, w = case_inputs((7,), 512, 64, 1, False)
    once = bf16_linear_triton(x, w, 1, True, splits=2)
    report(dict(name="x_quantized_in_the_kernel", same=torch.equal(once, bf16_linear_triton(fp8_qdq(x), w, 1, False,
                                                                                            splits=2))))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_bf16_linear", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    result, (shape, _, n, _, _, exact, _) = interpreted[name], CASES[name]
    assert result["shape"] == [*shape, n]
    if exact:
        assert result["same"], result
    else:  # another summation order can move a bf16 rounding
        assert result["err"] <= 1e-2, result


@requires_interpreter
def test_x_quantized_in_the_kernel_equals_before_it(interpreted):
    assert interpreted["x_quantized_in_the_kernel"]["same"]


@pytest.mark.parametrize("groups, quantize", [(1, True), (4, False)])
@torch.no_grad()
def test_quantlinear_few_rows_path_gives_the_same_bits_on_cpu(groups, quantize):
    """With few_rows set QuantLinear calls the op (its reference on CPU): the plain path's bits; one row more
    than few_rows takes the plain path."""
    torch.manual_seed(0)
    linear = QuantLinear(64, 96, quantize_input=quantize, groups=groups)
    torch.nn.init.normal_(linear.weight, std=0.05)
    x = torch.randn(2, 3, groups * 64).bfloat16()
    plain = linear(x)
    linear.few_rows = 6
    assert torch.equal(linear(x), plain)
    linear.few_rows = 5
    assert torch.equal(linear(x), plain)


def test_tall_launch(monkeypatch):
    """At 64 rows an input FP8-rounded before the op gets 4 stages and, unsplit, 128-wide K blocks at 8 warps
    (wo_a); split (wo_b: 3 splits) 64-wide at 4; with the FP8 in the kernel the 64-wide blocks and 3 stages of
    before."""
    from dsflash_compile.custom_ops import bf16_linear_triton as module

    cuda = torch.device("cuda")
    monkeypatch.setattr(module, "_num_sms", lambda device: 132)
    wo_a = module.launch(64, 8192, 4096, 8, cuda, False)
    wo_b = module.launch(64, 5120, 8192, 1, cuda, False)
    in_kernel = module.launch(64, 5120, 8192, 1, cuda, True)
    assert (wo_a["block_k"], wo_a["splits"], wo_a["num_warps"], wo_a["num_stages"]) == (128, 1, 8, 4)
    assert (wo_b["block_k"], wo_b["splits"], wo_b["num_warps"], wo_b["num_stages"]) == (64, 3, 4, 4)
    assert (in_kernel["block_k"], in_kernel["num_warps"], in_kernel["num_stages"]) == (64, 4, 3)


@pytest.mark.parametrize("quantize", [True, False])
@torch.no_grad()
def test_quantlinear_tall_rows_path(quantize):
    """With tall_rows set, inputs of that many rows run fp8_qdq (with quantize_input) then bf16_linear without
    the FP8 in it: the plain path's bits on CPU; other row counts keep cuBLAS's path (make_fx graphs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    linear = QuantLinear(64, 96, quantize_input=quantize, groups=2)
    torch.nn.init.normal_(linear.weight, std=0.05)
    x = torch.randn(40, 128).bfloat16()
    plain = linear(x)
    linear.tall_rows = (33, 64)
    assert torch.equal(linear(x), plain)
    calls = [n for n in make_fx(linear)(x).graph.nodes if n.op == "call_function"]
    ops = [str(n.target) for n in calls]
    assert "dsflash.bf16_linear.default" in ops and ("dsflash.fp8_qdq.default" in ops) == quantize
    linear_args = [n.args for n in calls if str(n.target) == "dsflash.bf16_linear.default"]
    assert linear_args[0][2:] == (2, False)
    ops = [str(n.target) for n in make_fx(linear)(x[:32]).graph.nodes if n.op == "call_function"]
    assert "dsflash.bf16_linear.default" not in ops


def test_opcheck_and_errors():
    x, w = case_inputs((3,), 64, 32, 2, True)
    for groups, quantize in ((2, True), (2, False)):
        torch.library.opcheck(torch.ops.dsflash.bf16_linear.default, (x, w, groups, quantize))
    op = torch.ops.dsflash.bf16_linear
    with pytest.raises(TypeError, match="must be bf16"):
        op(x.float(), w, 2, True)
    with pytest.raises(ValueError, match="do not split into groups=3"):
        op(x, w, 3, True)
    with pytest.raises(ValueError, match="x has 128 inputs"):
        op(x, w, 1, True)
    with pytest.raises(ValueError, match="multiple of the FP8 group"):
        op(x[:, :48], w[:, :48], 1, True)
    with pytest.raises(ValueError, match="linear_few_rows=65"):
        CompileOptions(linear_few_rows=65)


_KERNEL = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32",
               rot_ptr="*fp32", M="i32", N="i32", K="i32", n_per_group="i32", k_blocks_per_split="i32", splits="i32",
               head_dim="i32")


@pytest.mark.parametrize("rows, name, quantize", [(1, "wo_b", True), (1, "wq_b", True), (32, "wo_b", True),
                                                (64, "wo_b", True), (64, "wq_b", True), (64, "wo_b", False),
                                                (64, "wo_a", False)])
def test_kernel_compiles_for_hopper_without_spills(rows, name, quantize, monkeypatch):
    """The default launch of each row tile on the H200's 132 SMs (32- and 64-wide output blocks), with the
    release's FP8 of x or (64 rows: wo_a and wo_b, QuantLinear.tall_rows) an input FP8-rounded before it."""
    from dsflash_compile.custom_ops import bf16_linear_triton as module

    monkeypatch.setattr(module, "_num_sms", lambda device: 132)
    k, n, groups, _ = RELEASE[name]
    launch = module.launch(rows, n, k, groups, torch.device("cuda"), quantize)
    assert launch["block_n"] == (64 if name == "wq_b" else 32)
    constexprs = dict(QUANT_X=quantize, ONE_ROW=rows == 1, BLOCK_M=launch["block_m"], BLOCK_N=launch["block_n"],
                      BLOCK_K=launch["block_k"], EVEN_K=True, FP32_DOT=False, PAIRS=0)
    check_compiles_for_hopper(module, ("_bf16_linear_kernel", _KERNEL, constexprs, launch["num_warps"]))


# ----------------------------------------------------------------------------------------------- CUDA

# the flash-40l-e8 bf16 decode projections: (K per group, N, groups, quantize_x)
RELEASE = {"wq_a+wkv": (5120, 1792, 1, True), "wq_b": (1280, 32768, 1, True), "wo_a": (4096, 8192, 8, False),
           "wo_b": (8192, 5120, 1, True), "indexer_wq_b": (1280, 4096, 1, True)}


@requires_cuda
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("name", list(RELEASE))
def test_release_sizes_on_cuda(name, rows):
    """The kernel against the reference (cuBLAS: another summation order) at the default launch, replayed in a
    CUDA graph on new x (the split counters left at zero), and opcheck."""
    k, n, groups, quantize = RELEASE[name]
    x, w = case_inputs((rows,), k, n, groups, False, device="cuda")
    got = torch.ops.dsflash.bf16_linear(x, w, groups, quantize)
    want = bf16_linear_reference(x, w, groups, quantize)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dsflash.bf16_linear(x, w, groups, quantize)
    x.copy_(case_inputs((rows,), k, n, groups, False, seed=1, device="cuda")[0])
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, torch.ops.dsflash.bf16_linear(x, w, groups, quantize))
    torch.library.opcheck(torch.ops.dsflash.bf16_linear.default, (x, w, groups, quantize))
