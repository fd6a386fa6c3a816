"""The query's RMSNorm in wq_b's kernel (issue 5): bf16_linear_tma_triton.py's NORM prologue (through
`dsflash::bf16_gemv`'s norm_weight) and the pass that folds an RMSNorm read only by a one-row TMA-sized projection
into it (passes/linear_norm.py).

The kernel under the interpreter against the norm run apart then the same kernel (within a bf16 ulp: the sum of
squares adds in another order) and against the reference; the pass on small compiled functions (matched and
replaced nodes, outputs equal to eager, a norm with another reader kept); compiled for sm_90 without spills; on a
GPU at the release's wq_b with its RoPE, and in a CUDA graph."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_bf16_linear import RELEASE, case_inputs
from test_compile import fresh_dynamo  # noqa: F401  (fixture)
from test_linear_rope import rope_inputs
from test_mhc_fusion import bf16_ulps
from torch._inductor import config as inductor_config

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile import passes
from dsflash_compile.custom_ops import bf16_linear_tma_triton as tma
from dsflash_compile.custom_ops.bf16_gemv import gemv_reference
from dsflash_compile.custom_ops.mhc import rms_norm
from dsflash_compile.layers import RMSNorm
from dsflash_compile.passes import DsflashPassManager, LinearNormPass, LinearRopePass

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ops = torch.ops.dsflash
EPS = 1e-6

# name: (K, N, quantize_x, pairs (RoPE of 64-wide heads' tails, 0: none), launch)
CASES = {
    "quantized": (512, 64, True, 0, dict(block_n=32, block_k=128, num_stages=2)),
    "ragged_k": (224, 96, True, 0, dict(block_n=32, block_k=64, num_stages=3)),  # a last tile 32 wide
    "plain_rope": (256, 128, False, 8, dict(block_n=64, block_k=64, num_stages=2)),
}


def norm_inputs(k, n, seed=0, device="cpu"):
    x, w = case_inputs((1,), k, n, 1, exact=False, seed=seed, device=device)
    norm_weight = (1 + torch.randn(k, generator=torch.Generator().manual_seed(seed + 7)) / 4).bfloat16()
    return x, w, norm_weight.to(device)


def interpreter_checks():
    """Entry point of the subprocess: the kernel with its norm against the norm apart and the reference."""
    for name, (k, n, quantize, pairs, launch) in CASES.items():
        x, w, norm_weight = norm_inputs(k, n)
        rot = rope_inputs((1,), k, n // 64, 64, pairs)[2] if pairs else None
        head_dim = 64 if pairs else 0
        got = tma.bf16_linear_tma(x, w, 1, quantize, rot, head_dim, norm_weight, EPS, **launch)
        apart = tma.bf16_linear_tma(rms_norm(x, norm_weight, EPS), w, 1, quantize, rot, head_dim, **launch)
        want = gemv_reference(x, w, 1, quantize, rot, head_dim, norm_weight, EPS)
        report(dict(name=name, shape=list(got.shape), ulps_apart=bf16_ulps(got, apart),
                    err=((got - want).abs().max() / want.abs().max()).item()))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_linear_norm", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_norms_its_input(interpreted, name):
    result = interpreted[name]
    assert result["shape"] == [1, CASES[name][1]], result
    assert result["ulps_apart"] <= 1, result
    assert result["err"] <= 1e-2, result  # the reference: another summation order


def test_rejects_a_norm_over_groups():
    x, w, norm_weight = norm_inputs(64, 64)
    with pytest.raises(ValueError, match="norm needs one group and K <= 8192"):
        tma.bf16_linear_tma(x.repeat(1, 2), w, 2, True, norm_weight=norm_weight, norm_eps=EPS, block_n=16)


# ----------------------------------------------------------------------------------------------- the pass

class Counting(DsflashPassManager):
    """The passes, then the dsflash ops left in the graph (and whether an RMSNorm's rsqrt is)."""

    def __init__(self, *pass_list):
        super().__init__(list(pass_list))
        self.ops = []

    def __call__(self, graph):
        super().__call__(graph)
        self.ops.append(sorted(str(n.target) for n in graph.nodes if n.op == "call_function"
                               and (str(n.target).startswith("dsflash") or n.target is torch.ops.aten.rsqrt.default)))


NORM = RMSNorm(64, EPS)
with torch.no_grad():
    NORM.weight.copy_(norm_inputs(64, 64)[2])


def query(x, w):
    return ops.bf16_linear(NORM(x), w, 1, True)


def one_row_query(x, w):
    return ops.bf16_gemv(NORM(x), w, 1, True)


def query_and_norm(x, w):
    """The normed row read besides the projection (an index source's indexer): not folded."""
    normed = NORM(x)
    return ops.bf16_gemv(normed, w, 1, True), normed


def roped_query(x, w, rot):
    q = ops.bf16_gemv(NORM(x), w, 1, True).unflatten(-1, (2, 64))
    ops.rope_(q, rot)
    return q


@pytest.fixture
def tma_sized(monkeypatch):
    """The test's 64 x 128 weight taken as TMA-sized (the release's wq_b: 84 MB)."""
    monkeypatch.setattr(tma, "MIN_K", 64)
    monkeypatch.setattr(tma, "MIN_BYTES", 0)


@pytest.mark.parametrize("fn, folded", [(query, 1), (one_row_query, 1), (query_and_norm, 0), (roped_query, 1)])
def test_pass_folds_the_norm_into_the_projection(fresh_dynamo, tma_sized, fn, folded):  # noqa: F811
    x, w, rot = rope_inputs((1, 1), 64, 2, 64, 8)
    args = (x, w, rot) if fn is roped_query else (x, w)
    manager = Counting(LinearRopePass(), LinearNormPass())
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):
        passes.use(manager)
        got = torch.compile(fn, fullgraph=True)(*args)
        passes.use(None)
    assert manager.matches == {"linear_rope": int(fn is roped_query), "linear_norm": folded}
    if folded:
        assert manager.ops == [["dsflash.bf16_gemv.default"]]
    else:
        assert "aten.rsqrt.default" in manager.ops[0]
    with torch.no_grad():
        want = fn(*args)
    for g, r in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, r)  # on the CPU the op norms with the model's own arithmetic


def test_pass_leaves_weights_the_tma_kernel_does_not_take(fresh_dynamo):  # noqa: F811
    x, w, _ = rope_inputs((1, 1), 64, 2, 64, 8)
    manager = Counting(LinearNormPass())
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):
        passes.use(manager)
        torch.compile(query, fullgraph=True)(x, w)
        passes.use(None)
    assert manager.matches == {"linear_norm": 0}


def test_compile_option_installs_the_pass(fresh_dynamo):  # noqa: F811
    from test_compile import tiny_model

    def installed(**options):
        dsflash_compile.compile(tiny_model(), max_batch=2, max_length=32, backend="eager", **options)
        return any(isinstance(p, LinearNormPass) for p in inductor_config.post_grad_custom_post_pass.passes)

    assert installed(linear_norm=True) and not installed()  # off by default: slower on the H200 (12-04 d5)


@pytest.mark.parametrize("pairs", [0, 32])
def test_kernel_compiles_for_hopper_without_spills(pairs):
    """wq_b's launch with the norm (and the release's 32 RoPE pairs of 512-wide heads)."""
    launch = tma.launch(RELEASE["wq_b"][0])
    args = dict(x_ptr="*bf16", w_ptr="*bf16", w_desc=f"tensordesc<bf16[{launch['block_n']},{launch['block_k']}]>",
                out_ptr="*bf16", rot_ptr="*fp32", norm_w_ptr="*bf16", K="i32", n_per_group="i32", head_dim="i32",
                eps="fp32")
    constexprs = dict(QUANT_X=True, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"], NORM_ROW=2048,
                      PAIRS=pairs, PREFETCH_K=0, FP32_DOT=False)
    check_compiles_for_hopper(tma, ("_tma_gemv_kernel", args, constexprs, launch["num_warps"], launch["num_stages"]),
                              divisible_by_16=("x_ptr", "w_ptr", "out_ptr", "rot_ptr", "norm_w_ptr", "K",
                                               "n_per_group", "head_dim"))


# ----------------------------------------------------------------------------------------------- CUDA

@requires_cuda
def test_cuda_release_wq_b_with_its_norm():
    """wq_b (1280 -> 64 heads of 512, 32 RoPE pairs) through bf16_gemv with the norm: the TMA kernel, within a bf16
    ulp of the norm run apart then the op, near the reference; replayed in a CUDA graph on new inputs."""
    k, n, _, _ = RELEASE["wq_b"]
    x, w, norm_weight = norm_inputs(k, n, device="cuda")
    rot = rope_inputs((1, 1), k, 64, 512, 32, device="cuda")[2]
    x = x.view(1, 1, k)
    got = ops.bf16_gemv(x, w, 1, True, rot, 512, norm_weight, EPS)
    apart = ops.bf16_gemv(rms_norm(x, norm_weight, EPS), w, 1, True, rot, 512)
    assert bf16_ulps(got, apart) <= 1
    want = gemv_reference(x, w, 1, True, rot, 512, norm_weight, EPS)
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.bf16_gemv(x, w, 1, True, rot, 512, norm_weight, EPS)
    x.copy_(norm_inputs(k, n, seed=3, device="cuda")[0].view(1, 1, k))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, ops.bf16_gemv(x, w, 1, True, rot, 512, norm_weight, EPS))
