"""The query's RoPE in wq_b's epilogue (issue 5): `dsflash::bf16_linear` with `rot` (custom_ops/bf16_linear.py,
bf16_linear_triton._finish_tile) and the pass that joins a linear and the rope_ of its heads
(passes/linear_rope.py).

The kernel under the interpreter against the linear then `dsflash::rope_`'s kernel (the same bits: both rotate the
rounded output with the same arithmetic) and against the reference; the op's checks and opcheck; the pass on a
small compiled function (matched and replaced nodes, outputs equal to eager); compiled for sm_90 without spills;
on a GPU at the release's wq_b against the two kernels, bit for bit, and in a CUDA graph."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_bf16_linear import RELEASE, case_inputs
from test_compile import fresh_dynamo  # noqa: F401  (fixture)
from test_mhc_fusion import bf16_ulps
from torch._inductor import config as inductor_config

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile import passes
from dsflash_compile.custom_ops.bf16_linear import bf16_linear_reference
from dsflash_compile.passes import DsflashPassManager, LinearRopePass
from dsflash_compile.rope import apply_rope

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ops = torch.ops.dsflash

# name: (rows (leading shape), K, heads, head_dim, pairs, quantize_x, launch overrides)
CASES = {
    "one_row": ((1,), 256, 4, 64, 16, True, {"block_n": 32, "splits": 1}),  # the tail: one whole block a head
    "one_row_split": ((1,), 512, 4, 64, 8, True, {"block_n": 32, "splits": 2}),  # the tail inside a block
    "rows_narrow_blocks": ((2, 3), 128, 8, 32, 16, False, {"block_n": 16, "splits": 1}),  # the tail: 2 blocks
    "rows_split": ((5,), 256, 2, 128, 32, True, {"block_n": 64, "splits": 2}),  # one block is half a head
}


def rope_inputs(shape, k, heads, head_dim, pairs, seed=0, device="cpu"):
    x, w = case_inputs(shape, k, heads * head_dim, 1, exact=False, seed=seed, device=device)
    angles = torch.rand(*shape, pairs, generator=torch.Generator().manual_seed(seed + 1)) * 6.3
    rot = torch.stack([angles.cos(), angles.sin()], dim=-1).to(device)
    return x, w, rot


# the one-row TMA kernel's (bf16_linear_tma_triton.py: wq_b at decode batch 1): (K, heads, head_dim, pairs, launch)
TMA_CASES = {
    "tma_block_in_head": (256, 4, 64, 16, {"block_n": 32, "block_k": 64, "num_stages": 2}),  # the tail: one block
    "tma_heads_in_block": (128, 8, 32, 8, {"block_n": 64, "block_k": 64, "num_stages": 2}),  # 2 heads a block
}


def interpreter_checks():
    """Entry point of the subprocess: the kernels with their epilogue against the linear then the RoPE's kernel and
    against the reference."""
    from dsflash_compile.custom_ops.bf16_linear_tma_triton import bf16_linear_tma
    from dsflash_compile.custom_ops.bf16_linear_triton import bf16_linear_triton
    from dsflash_compile.custom_ops.rope_tail_triton import rope_tail_triton_

    cases = {**CASES, **{name: ((1,), k, heads, head_dim, pairs, True, dict(launch, tma=True))
                         for name, (k, heads, head_dim, pairs, launch) in TMA_CASES.items()}}
    for name, (shape, k, heads, head_dim, pairs, quantize, launch) in cases.items():
        x, w, rot = rope_inputs(shape, k, heads, head_dim, pairs)
        launch = dict(launch)
        linear = bf16_linear_tma if launch.pop("tma", False) else bf16_linear_triton
        got = linear(x, w, 1, quantize, rot=rot, head_dim=head_dim, **launch)
        apart = linear(x, w, 1, quantize, **launch).unflatten(-1, (heads, head_dim)).contiguous()
        rope_tail_triton_(apart, rot)
        want = bf16_linear_reference(x, w, 1, quantize, rot, head_dim)
        report(dict(name=name, same_as_apart=torch.equal(got, apart.flatten(-2)), shape=list(got.shape),
                    err=((got - want).abs().max() / want.abs().max()).item()))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_linear_rope", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES) + list(TMA_CASES))
def test_kernel_equals_linear_then_rope(interpreted, name):
    result = interpreted[name]
    shape, (heads, head_dim) = (CASES[name][0], CASES[name][2:4]) if name in CASES else ((1,), TMA_CASES[name][1:3])
    assert result["shape"] == [*shape, heads * head_dim]
    assert result["same_as_apart"], result
    assert result["err"] <= 1e-2, result  # the reference: another summation order


def test_reference_is_the_linear_then_its_heads_rope():
    x, w, rot = rope_inputs((2,), 64, 4, 32, 8)
    lin = bf16_linear_reference(x, w, 1, True)
    want = apply_rope(lin.unflatten(-1, (4, 32)), rot).flatten(-2)
    assert torch.equal(ops.bf16_linear(x, w, 1, True, rot, 32), want)
    torch.library.opcheck(ops.bf16_linear.default, (x, w, 1, True, rot, 32))


def test_errors_name_the_problem():
    x, w, rot = rope_inputs((2,), 64, 4, 32, 8)
    with pytest.raises(ValueError, match="head_dim dividing the 128 outputs"):
        ops.bf16_linear(x, w, 1, True, rot, 48)
    with pytest.raises(ValueError, match="rot has shape"):
        ops.bf16_linear(x, w, 1, True, rot[:1], 32)
    with pytest.raises(ValueError, match="2 \\* pairs <= head_dim = 8"):
        ops.bf16_linear(x, w, 1, True, rot, 8)
    with pytest.raises(TypeError, match="rot must be fp32"):
        ops.bf16_linear(x, w, 1, True, rot.double(), 32)


# -- the pass --------------------------------------------------------------------------------------

class Counting(DsflashPassManager):
    """The pass alone, with the dsflash ops of each graph it saw."""

    def __init__(self):
        super().__init__([LinearRopePass()])
        self.ops = []

    def __call__(self, graph):
        super().__call__(graph)
        # a functionalized mutating op counts as its op
        names = [str(n.args[0] if n.target is torch.ops.higher_order.auto_functionalized_v2 else n.target)
                 for n in graph.nodes]
        self.ops.append(sorted(name for name in names if name.startswith("dsflash")))


def query(x, w, rot):
    q = ops.bf16_linear(x, w, 1, True).unflatten(-1, (4, 32))
    ops.rope_(q, rot)
    return q


def one_row_query(x, w, rot):
    """QuantLinear at decode batch 1: dsflash::bf16_gemv."""
    q = ops.bf16_gemv(x, w, 1, True).unflatten(-1, (4, 32))
    ops.rope_(q, rot)
    return q


def query_and_linear(x, w, rot):
    """The linear read besides its rotation: not folded."""
    lin = ops.bf16_linear(x, w, 1, True)
    q = lin.unflatten(-1, (4, 32)).clone()
    ops.rope_(q, rot)
    return q, lin.sum()


@pytest.mark.parametrize("fn, folded", [(query, 1), (one_row_query, 1), (query_and_linear, 0)])
def test_pass_folds_the_rope_into_the_linear(fresh_dynamo, fn, folded):  # noqa: F811
    x, w, rot = rope_inputs((1, 1), 64, 4, 32, 8)
    op = "dsflash.bf16_gemv.default" if fn is one_row_query else "dsflash.bf16_linear.default"
    manager = Counting()
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):
        passes.use(manager)
        got = torch.compile(fn, fullgraph=True)(x, w, rot)
        passes.use(None)
    assert manager.matches == {"linear_rope": folded}
    assert manager.ops == [[op] if folded else [op, "dsflash.rope_.default"]]
    want = fn(x, w, rot)
    for g, r in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, r)


def test_compile_option_installs_the_pass(fresh_dynamo):  # noqa: F811
    from test_compile import tiny_model

    def installed(**options):
        dsflash_compile.compile(tiny_model(), max_batch=2, max_length=32, backend="eager", **options)
        return any(isinstance(p, LinearRopePass) for p in inductor_config.post_grad_custom_post_pass.passes)

    assert installed() and not installed(linear_rope=False)  # on by default (H200 12-04 d4: the B1 step 0.3% faster)


_KERNEL = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32",
               rot_ptr="*fp32", M="i32", N="i32", K="i32", n_per_group="i32", k_blocks_per_split="i32", splits="i32",
               head_dim="i32")


@pytest.mark.parametrize("rows", [1, 16])
def test_kernel_compiles_for_hopper_without_spills(rows, monkeypatch):
    """wq_b's default launch at 1 and 16 rows with the release's 32 pairs of 512-wide heads."""
    from dsflash_compile.custom_ops import bf16_linear_triton as module

    monkeypatch.setattr(module, "_num_sms", lambda device: 132)
    k, n, groups, _ = RELEASE["wq_b"]
    launch = module.launch(rows, n, k, groups, torch.device("cuda"), True)
    constexprs = dict(QUANT_X=True, ONE_ROW=rows == 1, BLOCK_M=launch["block_m"], BLOCK_N=launch["block_n"],
                      BLOCK_K=launch["block_k"], EVEN_K=True, FP32_DOT=False, PAIRS=32)
    check_compiles_for_hopper(module, ("_bf16_linear_kernel", _KERNEL, constexprs, launch["num_warps"]))


# ----------------------------------------------------------------------------------------------- CUDA

@requires_cuda
def test_cuda_gemv_with_rope_on_either_kernel():
    """dsflash::bf16_gemv with rot: wq_b (too large for the GEMV's kernel: bf16_linear's epilogue) and a weight the
    GEMV takes (its kernel, then the RoPE's): the bits of the op without rot followed by dsflash::rope_."""
    for k, heads in [(RELEASE["wq_b"][0], 64), (1280, 8)]:
        x, w, rot = rope_inputs((1, 1), k, heads, 512, 32, device="cuda")
        apart = ops.bf16_gemv(x, w, 1, True).unflatten(-1, (heads, 512))
        ops.rope_(apart, rot)
        assert torch.equal(ops.bf16_gemv(x, w, 1, True, rot, 512), apart.flatten(-2)), (k, heads)


@requires_cuda
@pytest.mark.parametrize("rows", [1, 16])
def test_cuda_release_wq_b_equals_linear_then_rope(rows):
    """wq_b (1280 -> 64 heads of 512, 32 pairs): the op with `rot` against the linear and then dsflash::rope_'s
    kernel: the same bits at one row on this data (as the H200 compiled them, 12-03 a3), within one bf16 ulp at 16
    (the rotation's products may contract into other FMAs in the 16-row tile: H200, 12-03 a2); captured in a CUDA
    graph it replays to the eager result on new inputs."""
    k, n, _, _ = RELEASE["wq_b"]
    x, w, rot = rope_inputs((rows,), k, 64, 512, 32, device="cuda")
    got = ops.bf16_linear(x, w, 1, True, rot, 512)
    apart = ops.bf16_linear(x, w, 1, True).unflatten(-1, (64, 512))
    ops.rope_(apart, rot)
    if rows == 1:
        assert torch.equal(got, apart.flatten(-2))
    assert bf16_ulps(got, apart.flatten(-2)) <= 1
    want = bf16_linear_reference(x, w, 1, True, rot, 512)
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.bf16_linear(x, w, 1, True, rot, 512)
    new_x, _, new_rot = rope_inputs((rows,), k, 64, 512, 32, seed=5, device="cuda")
    x.copy_(new_x)
    rot.copy_(new_rot)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, ops.bf16_linear(x, w, 1, True, rot, 512))
