"""The MoE's router inside the FFN's seam (issue 5): `dsflash::mhc_seam_partials_routed` (custom_ops/mhc_deferred.py)
against the seam op then the router op, its kernel under the interpreter and for sm_90, the pass that folds the
router into the seam (passes/router_seam.py) and compile()'s option; on a GPU the kernel at release dims."""

import collections

import pytest
import torch

import dsflash_compile
from dsflash_compile.custom_ops.mhc import ROUTE_MAX_EXPERTS, SEAM_BLOCK_D
from dsflash_compile.custom_ops.router import fused_router_reference
from dsflash_compile.layers import RMSNorm
from dsflash_compile.mhc import hc_mixes, hc_post, hc_pre
from dsflash_compile.moe import route
from dsflash_compile.passes import MhcDeferPass, MhcFusionPass, RouterFusionPass, RouterSeamPass
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_compile import fresh_dynamo, tiny_model  # noqa: F401  (fresh_dynamo: a fixture)
from test_mhc_fusion import HC_EPS, ITERS, KERNEL_ARGS, NORM_EPS, compiling, seam_args  # noqa: F401

ops = torch.ops.dsflash
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (lead, D, experts, top-k): one token, several with a partial last chunk, gates of 7 and 5 (padded to 8)
CASES = [((1,), 64, 8, 6), ((2, 3), 200, 7, 4), ((1,), 1100, 5, 2)]
SCALE = 2.5


def router_args(dim, experts, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, dim, generator=g) * 0.1).bfloat16(), torch.randn(experts, generator=g) * 0.1


def routed(args, gate, bias, topk):
    out, streams, post, comb, pre_lagged, fn, _, _, weight = args
    return ops.mhc_seam_partials_routed(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS, gate, bias, topk,
                                        True, SCALE)


def test_op_is_the_seam_then_the_router():
    """The reference: mhc_seam_partials, then fused_router on its normed rows (flattened to tokens); opcheck."""
    for lead, dim, experts, topk in CASES:
        args = seam_args(lead, dim=dim)
        out, streams, post, comb, pre_lagged, fn, _, _, weight = args
        gate, bias = router_args(dim, experts)
        seam = ops.mhc_seam_partials(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS)
        router = ops.fused_router(seam[1].reshape(-1, dim), gate, bias, topk, True, SCALE)
        got = routed(args, gate, bias, topk)
        assert all(torch.equal(g, w) for g, w in zip(got, (*seam, *router), strict=True))
        torch.library.opcheck(ops.mhc_seam_partials_routed.default,
                              (out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS, gate, bias, topk, True,
                               SCALE))


# -- the kernel, under the interpreter and for sm_90 -----------------------------------------------

def interpreter_checks():
    """Entry point of the subprocess: the seam kernel routing its rows against the same launch without routing
    (its three outputs) and the router's reference on the rows it normed."""
    from dsflash_compile.custom_ops.mhc_triton import mhc_seam_triton

    for lead, dim, experts, topk in CASES:
        out, streams, post, comb, pre_lagged, fn, _, _, weight = seam_args(lead, dim=dim)
        gate, bias = router_args(dim, experts)
        launch = dict(block_d=SEAM_BLOCK_D, rows=False, finish_mixes=False)
        plain = mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, None, None, weight, NORM_EPS, 0.0, 0,
                                **launch)
        got = mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, None, None, weight, NORM_EPS, 0.0, 0,
                              route=(gate, bias, topk, True, SCALE), **launch)
        weights, ids = fused_router_reference(got[1].reshape(-1, dim), gate, bias, topk, True, SCALE)
        report(dict(name=f"{lead}-{dim}", seam_same=all(torch.equal(a, b) for a, b in zip(plain, got[:3])),
                    ids_same=torch.equal(ids, got[4]), shapes=[list(got[3].shape), list(got[4].shape)],
                    weights_err=((got[3] - weights).abs() / weights.abs()).max().item()))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_router_seam", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("lead, dim, experts, topk", CASES)
def test_kernel_routes_the_rows_it_normed(interpreted, lead, dim, experts, topk):
    """The seam's outputs do not change with routing on; the picks are the reference's on the normed rows, the
    weights within fp32 rounding (the logits are added in another order)."""
    r = interpreted[f"{lead}-{dim}"]
    tokens = torch.Size(lead).numel()
    assert r["seam_same"] and r["ids_same"] and r["shapes"] == [[tokens, topk]] * 2, r
    assert r["weights_err"] <= 1e-5, r


def test_routing_seam_kernel_compiles_for_hopper():
    """Release dims (hc 4, D 5120, 80 chunks), the deferred seam's launch (RMSNorm in one 8192 tile) routing the
    largest gate it takes (ROUTE_MAX_EXPERTS), top-6: sm_90 code without spills."""
    from dsflash_compile.custom_ops import mhc_deferred, mhc_triton

    constexprs = dict(HC=4, D=5120, BLOCK_D=SEAM_BLOCK_D, BLOCK_T=1, PART=32, CHUNKS_PAD=128,
                      NORM_BLOCK=mhc_deferred.NORM_BLOCK, ROUTE_TOPK=6, ROUTE_K_PAD=8, ROUTE_E_PAD=ROUTE_MAX_EXPERTS,
                      ROUTE_NORMALIZE=True, EARLY_FN=mhc_triton.EARLY_FN, ROW_LOADS_FIRST=mhc_triton.ROW_LOADS_FIRST)
    check_compiles_for_hopper(mhc_triton, ("_seam_kernel", KERNEL_ARGS, constexprs, 4))


def test_too_many_experts_are_refused():
    from dsflash_compile.custom_ops.mhc_triton import mhc_seam_triton

    out, streams, post, comb, pre_lagged, fn, _, _, weight = seam_args((1,))
    gate, bias = router_args(64, ROUTE_MAX_EXPERTS + 1)
    with pytest.raises(ValueError, match=f"at most {ROUTE_MAX_EXPERTS} experts"):
        mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, None, None, weight, NORM_EPS, 0.0, 0,
                        finish_mixes=False, route=(gate, bias, 2, True, SCALE))


# -- the pass --------------------------------------------------------------------------------------

class RoutedSeams:
    """Post-grad pass: the router fusion, the mHC fusion, the deferral, then the router into the seam; keeps
    the routers folded and the graph's dsflash ops."""

    def __init__(self, max_experts=ROUTE_MAX_EXPERTS):
        self.passes = [RouterFusionPass(2, True, SCALE), MhcFusionPass(NORM_EPS, HC_EPS, ITERS), MhcDeferPass(16),
                       RouterSeamPass(max_experts)]
        self.folded, self.ops = [], []

    def __call__(self, graph):
        self.folded.append([p.apply(graph) for p in self.passes][-1])
        self.ops.append(collections.Counter(str(n.target) for n in graph.nodes if str(n.target).startswith("dsflash")))


def seam_then_moe(experts, dim=64):
    """A seam whose normed rows feed a router and a stand-in FFN, then the expansion that reads its mixes (so
    the seam is deferred)."""
    norm = RMSNorm(dim, NORM_EPS)
    out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args((1, 2), dim=dim)
    norm.weight.data = weight
    gate, bias = router_args(dim, experts)

    def fn_(out, streams, post, comb, pre_lagged):
        new = hc_post(out, streams, post, comb)
        pre, post2, comb2 = hc_mixes(new, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
        x = norm(hc_pre(new, pre_lagged))
        weights, ids = route(x.reshape(-1, dim), gate, bias, 2, True, SCALE)
        y = (x * weights.sum(-1).view(1, 2, 1)).sin()  # the FFN
        return hc_post(y, new, post2, comb2), pre, ids
    return fn_, (out, streams, post, comb, pre_lagged)


def test_the_router_joins_its_seam(compiling):  # noqa: F811
    """The router reading the deferred seam's normed rows becomes one routed seam op; the outputs within bf16
    noise of the eager function's and the same experts picked."""
    fn, args = seam_then_moe(experts=8)
    seams = RoutedSeams()
    got = compiling(seams, fn)(*args)
    assert seams.folded == [1]
    assert seams.ops == [{"dsflash.mhc_seam_partials_routed.default": 1, "dsflash.mhc_mixes_finish.default": 1}]
    want = fn(*args)
    assert torch.equal(got[2], want[2])
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_a_gate_above_the_cutoff_keeps_its_router(compiling):  # noqa: F811
    fn, args = seam_then_moe(experts=8)
    seams = RoutedSeams(max_experts=4)
    compiling(seams, fn)(*args)
    assert seams.folded == [0] and seams.ops[0]["dsflash.fused_router.default"] == 1


def test_compile_options_install_the_pass(fresh_dynamo):  # noqa: F811
    """compile() installs the pass after the deferral with router_in_seam (off by default: it did not pay on the
    H200), not without the deferral."""
    def passes(**options):
        dsflash_compile.compile(tiny_model(), max_batch=2, max_length=32, backend="eager", **options)
        manager = torch._inductor.config.post_grad_custom_post_pass
        return [(type(p).__name__, p.options.get("max_experts")) for p in manager.passes][2:]

    rope = ("LinearRopePass", None), ("LinearScalePass", None), ("EarlyReadsPass", None)  # on by default, last
    assert passes(router_in_seam=True) == [("MhcDeferPass", None), ("RouterSeamPass", ROUTE_MAX_EXPERTS), *rope]
    assert passes() == [("MhcDeferPass", None), *rope]
    assert passes(router_in_seam=True, mhc_defer_mixes=False) == [*rope]


# -- on a GPU --------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("tokens", [1, 5])
def test_cuda_routed_seam_at_release_dims(tokens):
    """D 5120, flash-40l-e8's gate (8 experts, top-6, the release's scale): the seam's outputs bit for bit the
    deferred seam op's, the picks the router op's, the weights within its CUDA bound (2e-4 relative: another
    summation order of the logits); in a CUDA graph replayed on new inputs."""
    from test_router_triton import CUDA_WEIGHT_RTOL

    args = [t.cuda() for t in seam_args((tokens,), dim=5120)]
    gate, bias = (t.cuda() for t in router_args(5120, 8))
    out, streams, post, comb, pre_lagged, fn, _, _, weight = args
    got = ops.mhc_seam_partials_routed(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS, gate, bias, 6,
                                       True, SCALE)
    seam = ops.mhc_seam_partials(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS)
    weights, ids = ops.fused_router(seam[1].reshape(tokens, -1), gate, bias, 6, True, SCALE)
    assert all(torch.equal(g, w) for g, w in zip(got[:3], seam))
    assert torch.equal(got[4], ids)
    assert ((got[3] - weights).abs() / weights.abs()).max().item() <= CUDA_WEIGHT_RTOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = routed(args, gate, bias, 6)
    for arg, new in zip(args, seam_args((tokens,), dim=5120, seed=1)):
        arg.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, routed(args, gate, bias, 6), strict=True))
