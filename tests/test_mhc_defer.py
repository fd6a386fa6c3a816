"""mHC mixes deferred (issue 5): the seam ops that leave their mixes as partials and the finishing op
(custom_ops/mhc_deferred.py) against the fused seam, their kernels under the interpreter and for sm_90, and the
deferral pass (passes/mhc_defer.py) in the tiny model's layer loop; the GPU tests (skipped here) check the kernels'
bits against the fused seam's and the compiled decode graph."""

import collections

import pytest
import torch

import dsflash_compile
from dsflash_compile.custom_ops.mhc import SEAM_BLOCK_D
from dsflash_compile.custom_ops.mhc_deferred import (DEFER_MAX_TOKENS, mix_partials, partials_shape,
                                                     seam_partials_reference)
from dsflash_compile.mhc import hc_pre
from dsflash_compile.passes import MhcDeferPass, MhcFusionPass
from dsflash_compile.passes.graph_edit import views_and_readers
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_compile import fresh_dynamo, prompts, tiny_model  # noqa: F401  (fresh_dynamo: a fixture)
from test_mhc_fusion import HC_EPS, ITERS, NORM_EPS, bf16_ulps, compiling, seam_args, tiny_layer_loop  # noqa: F401

ops = torch.ops.dsflash
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CASES = [((1,), 64), ((2, 3), 96), ((DEFER_MAX_TOKENS,), 200)]  # D = 96, 200: a partial last chunk


def deferred_seam(out, streams, post, comb, pre_lagged, fn, scale, base, weight, early=False):
    """mhc_seam's five outputs from the deferred ops; out None: mhc_entry_seam's four. early: the finish
    starts before its PDL wait, with a kernel (a product of the normed rows) between it and the seam, as the
    deferral pass guarantees."""
    if out is None:
        *kept, partials = ops.mhc_entry_seam_partials(streams, pre_lagged, fn, weight, NORM_EPS)
    else:
        *kept, partials = ops.mhc_seam_partials(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS)
    after = [kept[-1] * 2] if early else []
    mixes = ops.mhc_mixes_finish(partials, scale, base, streams.shape[-1], NORM_EPS, HC_EPS, ITERS, after, early)
    return (*kept, *mixes)


def fused_seam(out, streams, post, comb, pre_lagged, fn, scale, base, weight):
    if out is None:
        return ops.mhc_entry_seam(streams, pre_lagged, fn, scale, base, weight, NORM_EPS, HC_EPS, ITERS)
    return ops.mhc_seam(out, streams, post, comb, pre_lagged, fn, scale, base, weight, NORM_EPS, HC_EPS, ITERS)


def differences(got, want) -> dict:
    """Per output: (largest |difference|, values differing)."""
    return {i: ((g.float() - w.float()).abs().max().item(), int((g != w).sum())) for i, (g, w) in
            enumerate(zip(got, want, strict=True))}


def check_against_fused(args, mixes_atol, early=False):
    """The deferred ops' outputs: the streams and normed rows with the fused seam's bits, the mixes within
    mixes_atol (the dot products are added in chunks first: another order); the entry seam too."""
    for entry in (False, True):
        seam_args_ = (None, args[1], None, None, *args[4:]) if entry else args
        diff = differences(deferred_seam(*seam_args_, early=early), fused_seam(*seam_args_))
        kept = 1 if entry else 2
        assert all(n == 0 for _, n in list(diff.values())[:kept]), diff
        assert all(d <= mixes_atol for d, _ in list(diff.values())[kept:]), diff


# -- the ops ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("lead, dim", CASES)
def test_deferred_ops_equal_the_fused_seam(lead, dim):
    check_against_fused(seam_args(lead, dim=dim), mixes_atol=1e-6)


def test_partials_are_the_chunks_sums():
    """Each partials row holds its chunk's dot products and sums of squares: the rows add up to the whole
    row's (the unchunked GEMV and means), and zeros past them."""
    out, streams, post, comb, pre_lagged, fn, *_ = seam_args((2,), dim=96)
    collapsed = hc_pre(streams, pre_lagged)
    partials = mix_partials(streams, fn, collapsed)
    assert partials.shape == partials_shape(streams.shape) == (2, 2, 32)
    flat = streams.flatten(-2).float()
    sums = partials.sum(-2)
    torch.testing.assert_close(sums[..., :24], flat @ fn.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums[..., 24], flat.square().sum(-1))
    torch.testing.assert_close(sums[..., 25], collapsed.float().square().sum(-1))
    assert not partials[..., 26:].any()


def test_deferred_ops_opcheck():
    out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args((3,))
    new, normed, partials = seam_partials_reference(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS)
    torch.library.opcheck(ops.mhc_seam_partials.default, (out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS))
    torch.library.opcheck(ops.mhc_entry_seam_partials.default, (streams, pre_lagged, fn, weight, NORM_EPS))
    torch.library.opcheck(ops.mhc_mixes_finish.default,
                          (partials, scale, base, 64, NORM_EPS, HC_EPS, ITERS, [normed]))


def test_deferred_ops_name_a_wrong_shape():
    out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args((2,))
    partials = ops.mhc_entry_seam_partials(streams, pre_lagged, fn, weight, NORM_EPS)[1]
    with pytest.raises(ValueError, match="fn has shape"):
        ops.mhc_seam_partials(out, streams, post, comb, pre_lagged, fn[:, :-1], weight, NORM_EPS)
    with pytest.raises(ValueError, match=r"expected fp32 \[\.\.\., 2, 32\] for hc 4 and D 128"):
        ops.mhc_mixes_finish(partials, scale, base, 128, NORM_EPS, HC_EPS, ITERS, [])
    with pytest.raises(ValueError, match="partials are torch.bfloat16"):
        ops.mhc_mixes_finish(partials.bfloat16(), scale, base, 64, NORM_EPS, HC_EPS, ITERS, [])
    with pytest.raises(ValueError, match="base has shape"):
        ops.mhc_mixes_finish(partials, scale, base[:-1], 64, NORM_EPS, HC_EPS, ITERS, [])


# -- the kernels, under the interpreter and for sm_90 ----------------------------------------------

def interpreter_checks():
    """Entry point of the subprocess: the seam kernel with its finish of the mixes off against the fused launch
    (the same launch otherwise), and its partials and the finish kernel against the references."""
    from dsflash_compile.custom_ops.mhc_mixes_finish_triton import mhc_mixes_finish_triton
    from dsflash_compile.custom_ops.mhc_triton import mhc_seam_triton

    for lead, dim in CASES:
        out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args(lead, dim=dim)
        consts = (NORM_EPS, HC_EPS, ITERS)
        fused = mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, scale, base, weight, *consts,
                                block_d=SEAM_BLOCK_D, rows=False)
        new, normed, partials = mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, None, None, weight,
                                                *consts, block_d=SEAM_BLOCK_D, rows=False, finish_mixes=False)
        want_partials = mix_partials(new, fn, hc_pre(new, pre_lagged))
        mixes = mhc_mixes_finish_triton(partials, scale, base, streams.shape[-2], dim, *consts)
        want_mixes = ops.mhc_mixes_finish(partials, scale, base, dim, *consts, [])
        err = (partials - want_partials).abs() / want_partials.abs().amax(-1, keepdim=True)
        same = dict(same_new=torch.equal(new, fused[0]), same_normed=torch.equal(normed, fused[1]))
        # norm off: no program finishes; the same streams and partials, the collapse un-normed
        new_u, collapsed, partials_u = mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, None, None, weight,
                                                       *consts, block_d=SEAM_BLOCK_D, rows=False,
                                                       finish_mixes=False, norm=False)
        same.update(unnormed_same=torch.equal(new_u, new) and torch.equal(partials_u, partials),
                    unnormed_ulps=bf16_ulps(collapsed, hc_pre(new, pre_lagged)))
        report(dict(name=f"{lead}-{dim}", **same,
                    partials_err=err[..., :25].max().item(),
                    collapse_err=((partials - want_partials).abs() / want_partials.abs())[..., 25].max().item(),
                    zeros=not partials[..., 26:].any(),
                    mixes_err=max((g - w).abs().max().item() for g, w in zip(mixes, want_mixes)),
                    fused_mixes_err=max((g - w).abs().max().item() for g, w in zip(mixes, fused[2:]))))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_mhc_defer", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("lead, dim", CASES)
def test_kernels_match_the_fused_seam_and_the_references(interpreted, lead, dim):
    """The seam kernel's streams and normed rows do not change with its mixes left as partials; the partials
    within fp32 rounding of the reference's chunk sums (relative to each row's largest), the collapse's sum of
    squares within 2% (the interpreter truncates the collapse's bf16 cast where the reference rounds: up to two
    bf16 ulps, 0.8%, on a square); the finish kernel's mixes within 2e-6 of the reference applied to those
    partials and of the fused launch's."""
    r = interpreted[f"{lead}-{dim}"]
    assert r["same_new"] and r["same_normed"] and r["zeros"], r
    assert r["partials_err"] <= 1e-5 and r["collapse_err"] <= 2e-2, r
    assert r["mixes_err"] <= 2e-6 and r["fused_mixes_err"] <= 2e-6, r
    assert r["unnormed_same"] and r["unnormed_ulps"] <= 2, r  # norm off: the collapse as above, before its norm


def test_seam_without_its_norm():
    """norm=False: the op gives the collapse before its RMSNorm (the reader norms it: passes/seam_norm_gemv.py),
    the streams and partials unchanged; the kernel refuses it where a program must finish the block."""
    args = seam_args((2,), dim=64)
    out, streams, post, comb, pre_lagged, fn, _, _, weight = args
    new, normed, partials = ops.mhc_seam_partials(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS)
    new_u, collapsed, partials_u = ops.mhc_seam_partials(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS,
                                                         False)
    assert torch.equal(new_u, new) and torch.equal(partials_u, partials)
    assert torch.equal(collapsed, hc_pre(new, pre_lagged))
    torch.library.opcheck(ops.mhc_seam_partials.default, (out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS,
                                                         False))
    mhc_triton = pytest.importorskip("dsflash_compile.custom_ops.mhc_triton")
    with pytest.raises(ValueError, match="norm=False"):
        mhc_triton.mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, None, None, weight, NORM_EPS, HC_EPS,
                                   ITERS, norm=False)  # the mixes finished in the seam: its last program finishes


@pytest.mark.parametrize("early", [True, False])
def test_finish_kernel_compiles_for_hopper(early):
    """Release dims (hc 4, D 5120: 80 chunks): sm_90 code without spills."""
    from dsflash_compile.custom_ops import mhc_mixes_finish_triton

    args = dict(partial_ptr="*fp32", scale_ptr="*fp32", base_ptr="*fp32", pre_out_ptr="*fp32", post_out_ptr="*fp32",
                comb_out_ptr="*fp32", chunks="i32", norm_eps="fp32", hc_eps="fp32", iters="i32")
    constexprs = dict(HC=4, D=5120, PART=32, CHUNKS_PAD=128, EARLY=early)
    check_compiles_for_hopper(mhc_mixes_finish_triton, ("_mixes_finish_kernel", args, constexprs, 4))


# -- the pass --------------------------------------------------------------------------------------

class DeferredSeams:
    """Post-grad pass: the mHC fusion, then the deferral; keeps counts, the graph's dsflash ops, whether each
    finish comes before every reader of its mixes and how many `after` tensors each finish takes."""

    def __init__(self, max_tokens=DEFER_MAX_TOKENS):
        self.fusion, self.defer = MhcFusionPass(NORM_EPS, HC_EPS, ITERS), MhcDeferPass(max_tokens)
        self.matches, self.deferred, self.ops, self.finish_first, self.after, self.early = [], [], [], [], [], []

    def __call__(self, graph):
        self.matches.append(self.fusion.apply(graph))
        self.deferred.append(self.defer.apply(graph))
        self.ops.append(collections.Counter(str(n.target) for n in graph.nodes if str(n.target).startswith("dsflash")))
        order = {n: i for i, n in enumerate(graph.nodes)}
        finishes = list(graph.find_nodes(op="call_function", target=ops.mhc_mixes_finish.default))
        self.finish_first.append(all(order[f] < min(order[r] for r in views_and_readers(list(f.users))[1])
                                     for f in finishes))
        self.after.append(sorted(len(f.args[7]) for f in finishes))
        self.early.append([f.args[8] for f in finishes])


def test_the_tiny_models_seams_are_deferred(compiling):  # noqa: F811
    """The tiny model's first 3 layers (Engram before layers 1 and 2) at 2 x 3 = 6 tokens: the 6 fused seams
    (3 full, 3 entry) are all deferred, each finish before its mixes' first reader (the next seam, the hc_post
    before Engram, the final collapse) and after at least one tensor of the sublayer; the output within bf16
    rounding of the fused seams' (the mixes' sums run in chunks first)."""
    layer_loop, inputs = tiny_layer_loop(layers=3)
    args = inputs(2, 3)
    fused = compiling(MhcFusionPass(NORM_EPS, HC_EPS, ITERS).apply, layer_loop)(*args)
    torch._dynamo.reset()
    seams = DeferredSeams()
    got = compiling(seams, layer_loop)(*args)
    assert seams.matches == [6] and seams.deferred == [6] and seams.finish_first == [True]
    assert min(seams.after[0]) >= 1 and seams.early == [[True] * 6]
    assert seams.ops == [{"dsflash.mhc_seam_partials.default": 3, "dsflash.mhc_entry_seam_partials.default": 3,
                          "dsflash.mhc_mixes_finish.default": 6}]
    torch.testing.assert_close(got, fused, rtol=2e-2, atol=2e-2)


def test_seams_above_the_cutoff_stay_fused(compiling):  # noqa: F811
    layer_loop, inputs = tiny_layer_loop(layers=2)
    seams = DeferredSeams(max_tokens=5)
    compiling(seams, layer_loop)(*inputs(2, 3))
    assert seams.matches == [4] and seams.deferred == [0]
    assert seams.ops == [{"dsflash.mhc_seam.default": 2, "dsflash.mhc_entry_seam.default": 2}]


def test_a_seam_with_nothing_between_it_and_its_reader_stays_fused(compiling):  # noqa: F811
    """Two seams back to back (no sublayer between the first's outputs and the second, which reads its
    mixes): the first keeps its finish (the finish kernel would start before the seam's end), the second,
    whose mixes are read after a sublayer, is deferred."""
    from dsflash_compile.mhc import hc_mixes, hc_post
    from dsflash_compile.layers import RMSNorm

    norm = RMSNorm(64, NORM_EPS)
    out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args((1,))
    norm.weight.data = weight

    def two_seams(out, streams, post, comb, pre_lagged):
        new = hc_post(out, streams, post, comb)
        pre, post, comb = hc_mixes(new, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
        x = norm(hc_pre(new, pre_lagged))
        newer = hc_post(x, new, post, comb)  # reads the first seam's mixes with no kernel between
        pre2, post2, comb2 = hc_mixes(newer, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
        y = norm(hc_pre(newer, pre)).sin()  # the sublayer
        return hc_post(y, newer, post2, comb2), pre2

    seams = DeferredSeams()
    got = compiling(seams, two_seams)(out, streams, post, comb, pre_lagged)
    assert seams.matches == [2] and seams.deferred == [1]
    assert seams.ops == [{"dsflash.mhc_seam.default": 1, "dsflash.mhc_seam_partials.default": 1,
                          "dsflash.mhc_mixes_finish.default": 1}]
    for g, w in zip(got, two_seams(out, streams, post, comb, pre_lagged)):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_compile_options_install_the_deferral(fresh_dynamo):  # noqa: F811
    """compile() installs the deferral pass after the fusion with DEFER_MAX_TOKENS by default, and not with
    mhc_defer_mixes=False."""
    def passes(**options):
        dsflash_compile.compile(tiny_model(), max_batch=2, max_length=32, backend="eager", **options)
        manager = torch._inductor.config.post_grad_custom_post_pass
        return [(type(p).__name__, p.options.get("max_tokens")) for p in manager.passes]

    rope = ("LinearRopePass", None), ("LinearScalePass", None), ("EarlyReadsPass", None)  # on by default, last
    assert passes()[1:] == [("MhcFusionPass", None), ("MhcDeferPass", DEFER_MAX_TOKENS), *rope]
    assert passes(mhc_defer_mixes=False)[1:] == [("MhcFusionPass", None), *rope]
    assert passes(mhc_overlap=True)[1:] == [("MhcFusionPass", None), ("MhcOverlapPass", 16),
                                            ("MhcDeferPass", DEFER_MAX_TOKENS), *rope]


# -- on a GPU --------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("lead, dim", [((1,), 5120), ((5,), 5120), ((DEFER_MAX_TOKENS,), 5120), ((2, 3), 200)])
def test_cuda_kernels_against_the_fused_seam(lead, dim, early):
    """Release D: the seam kernel with its mixes left as partials gives the fused seam's streams and normed rows
    bit for bit; the finish kernel's mixes within 1e-6 of the fused seam's (the same code in another kernel),
    finished after its PDL wait or, with a kernel between, before it; in a CUDA graph replayed on new inputs
    too."""
    args = [t.cuda() for t in seam_args(lead, dim=dim)]
    check_against_fused(args, mixes_atol=1e-6, early=early)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = deferred_seam(*args, early=early)
    for arg, new in zip(args, seam_args(lead, dim=dim, seed=1)):
        arg.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, deferred_seam(*args, early=early), strict=True))


@requires_cuda
@torch.no_grad()
def test_cuda_graph_decode_with_deferred_mixes(fresh_dynamo):  # noqa: F811
    """The tiny model's captured decode graph (2 rows) with the deferral on: both seams of every distinct block
    deferred, and logits within bf16 noise of the seams finished in place, replay after replay the same."""
    from test_mhc_overlap import decode_runs
    from test_compile import distinct_roles

    model = tiny_model().cuda()
    ids = prompts(2, 28).cuda()
    runs = {}
    for defer in (True, False):
        runs[defer], matches, _ = decode_runs(model, ids, "mhc_defer", mhc_defer_mixes=defer)
        assert matches == (2 * distinct_roles(model) if defer else 0)
    for a, b, c in zip(*runs[True], runs[False][0], strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=0.05, atol=0.05)

