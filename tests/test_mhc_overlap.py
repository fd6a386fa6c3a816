"""mHC overlap (issue 8): the split seam ops (custom_ops/mhc_split.py) equal the fused ones bit for bit, the
overlap pass (passes/mhc_overlap.py) splits the tiny model's seams and joins before every reader, and
compile() gives the same bits with overlap on and off. On the CPU the side stream is the current stream;
the GPU tests (skipped here) check the decode CUDA graph and that the mixes run on another stream."""

import collections
import json
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import dsflash_compile
from dsflash_compile.compiled import CompileOptions
from dsflash_compile.layers import RMSNorm
from dsflash_compile.passes import MhcFusionPass, MhcOverlapPass
from dsflash_compile.custom_ops.mhc import ROWS_MIN_TOKENS
from dsflash_compile.passes.graph_edit import views_and_readers
from test_compile import distinct_roles, fresh_dynamo, prompts, tiny_model  # noqa: F401  (fresh_dynamo: a fixture)
from graph_caches import graph_caches_off
from interp import report, requires_interpreter, run_interpreted
from test_mhc_fusion import (HC_EPS, ITERS, KERNEL_CASES, NORM_EPS, compiling,  # noqa: F401  (a fixture)
                             one_seam, seam_args, tiny_layer_loop)

ops = torch.ops.dsflash
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream and CUDA graphs need a GPU")


def split_seam(out, streams, post, comb, pre_lagged, fn, scale, base, weight):
    """The five outputs of mhc_seam, from the split ops (joined)."""
    new, normed = ops.mhc_seam_input(out, streams, post, comb, pre_lagged, weight, NORM_EPS)
    mixes = ops.mhc_mixes(new, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    ops.mhc_join_(*mixes, [normed])
    return (new, normed, *mixes)


def split_entry_seam(streams, pre_lagged, fn, scale, base, weight):
    mixes = ops.mhc_mixes(streams, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    normed = ops.mhc_entry_input(streams, pre_lagged, weight, NORM_EPS)
    ops.mhc_join_(*mixes, [normed])
    return (normed, *mixes)


# Up to the overlap pass's cutoff (CompileOptions.mhc_overlap_max_tokens), the largest seam it splits. The H200
# once gave split != fused bits at 16 and 20 tokens, when the halves were compiled apart; one binary since.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("lead", [(1,), (2, 3), (CompileOptions().mhc_overlap_max_tokens,)])
def test_split_ops_equal_the_fused_ops(device, lead):
    """On CUDA the same Triton kernel with half its work switched off: the same bits as one launch."""
    out, streams, post, comb, pre_lagged, fn, scale, base, weight = (t.to(device) for t in seam_args(lead))
    fused = ops.mhc_seam(out, streams, post, comb, pre_lagged, fn, scale, base, weight, NORM_EPS, HC_EPS, ITERS)
    got = split_seam(out, streams, post, comb, pre_lagged, fn, scale, base, weight)
    assert_same_bits(got, fused, ("new streams", "normed", "pre", "post", "comb"))
    fused = ops.mhc_entry_seam(streams, pre_lagged, fn, scale, base, weight, NORM_EPS, HC_EPS, ITERS)
    got = split_entry_seam(streams, pre_lagged, fn, scale, base, weight)
    assert_same_bits(got, fused, ("entry normed", "entry pre", "entry post", "entry comb"))


def assert_same_bits(got, want, names):
    """Names each output that differs, with its largest difference and how many values differ."""
    differ = {name: (f"{(g.float() - w.float()).abs().max().item():.3g}", int((g != w).sum()))
              for name, g, w in zip(names, got, want, strict=True) if not torch.equal(g, w)}
    assert not differ, f"split != fused (max |diff|, values differing): {differ}"


def test_split_ops_opcheck():
    out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args((3,))
    torch.library.opcheck(ops.mhc_seam_input.default, (out, streams, post, comb, pre_lagged, weight, NORM_EPS))
    torch.library.opcheck(ops.mhc_entry_input.default, (streams, pre_lagged, weight, NORM_EPS))
    torch.library.opcheck(ops.mhc_mixes.default, (streams, fn, scale, base, NORM_EPS, HC_EPS, ITERS))
    torch.library.opcheck(ops.mhc_join_.default, (*(t.clone() for t in (pre_lagged, post, comb)), [out]))


def test_split_op_names_a_wrong_shape():
    out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args((2,))
    with pytest.raises(ValueError, match="comb has shape"):
        ops.mhc_seam_input(out, streams, post, comb[..., :-1], pre_lagged, weight, NORM_EPS)
    with pytest.raises(ValueError, match="fn has shape"):
        ops.mhc_mixes(streams, fn[:, :-1], scale, base, NORM_EPS, HC_EPS, ITERS)


class SplitSeams:
    """Post-grad pass: the mHC fusion, then the overlap split; keeps counts and the graph's dsflash ops."""

    def __init__(self, max_tokens=16):
        self.fusion, self.overlap = MhcFusionPass(NORM_EPS, HC_EPS, ITERS), MhcOverlapPass(max_tokens)
        self.matches, self.splits, self.ops, self.joins_first = [], [], [], []

    def __call__(self, graph):
        self.matches.append(self.fusion.apply(graph))
        self.splits.append(self.overlap.apply(graph))
        self.ops.append(collections.Counter(str(n.target) for n in graph.nodes if str(n.target).startswith("dsflash")))
        self.joins_first.append(joins_precede_readers(graph))


def joins_precede_readers(graph) -> bool:
    """Every mhc_mixes output (or view of one) is first used by the mhc_join_ of those outputs."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in graph.find_nodes(op="call_function", target=ops.mhc_mixes.default):
        items = list(node.users)
        views, readers = views_and_readers(items)
        first = min(views | readers, key=order.__getitem__, default=None)
        if first is None or first.target is not ops.mhc_join_.default or set(first.args[:3]) != set(items):
            return False
    return True


def forks_overlap_kernels(code: str) -> bool:
    """In Inductor's generated `call`, every mhc_mixes call is followed by a kernel of the next sublayer
    before its mhc_join_: the scheduler did not move the fork down to the join, so there is work to overlap."""
    body = code[code.index("def call("):]
    calls = re.findall(r"torch\.ops\.\w+\.(\w+)\.default\(|extern_kernels\.(\w+)\("
                       r"|(?:cpp_fused|triton)_(\w+)(?:\.run)?\(", body)
    forked = False
    for op in ("".join(call) for call in calls):
        if op == "mhc_mixes":
            forked = True
        elif op == "mhc_join_" and forked:
            return False
        elif op not in ("mhc_join_", "mhc_seam_input", "mhc_entry_input"):
            forked = False
    return True


def test_the_tiny_models_seams_are_split(compiling):  # noqa: F811
    """The tiny model's first 3 layers (Engram before layers 1 and 2) at 2 x 3 = 6 tokens: the 6 fused seams
    (3 full, 3 entry: block 0's and the two after Engram) are all split, each joined before its mixes' first
    reader (the next seam's op, or Inductor's kernels: the hc_post before Engram, the final collapse), and the
    output has the same bits as with the seams fused."""
    layer_loop, inputs = tiny_layer_loop(layers=3)
    args = inputs(2, 3)
    fused = compiling(MhcFusionPass(NORM_EPS, HC_EPS, ITERS).apply, layer_loop)(*args)
    torch._dynamo.reset()
    seams = SplitSeams()
    got, (code,) = run_and_get_code(compiling(seams, layer_loop), *args)
    assert seams.matches == [6] and seams.splits == [6] and seams.joins_first == [True]
    assert forks_overlap_kernels(code)
    assert seams.ops == [{"dsflash.mhc_seam_input.default": 3, "dsflash.mhc_entry_input.default": 3,
                          "dsflash.mhc_mixes.default": 6, "dsflash.mhc_join_.default": 6}]
    assert torch.equal(got, fused)


def test_seams_above_the_cutoff_stay_fused(compiling):  # noqa: F811
    """One seam of 6 tokens with a cutoff of 5: fused, one launch."""
    norm = RMSNorm(64, NORM_EPS)
    args = seam_args((2, 3))
    norm.weight.data = args[-1]
    seams = SplitSeams(max_tokens=5)
    compiling(seams, one_seam(norm))(*args[:-1])
    assert seams.matches == [1] and seams.splits == [0]
    assert seams.ops == [{"dsflash.mhc_seam.default": 1}]


def test_compile_options_set_the_cutoff(fresh_dynamo):  # noqa: F811
    """compile() installs the overlap pass after the fusion pass with the options' cutoff when asked
    (mhc_overlap=True), and not by default. (That compiled outputs keep their bits is the tiny layer loop's test
    above on the CPU, and the decode graph's test below on a GPU: a CPU compile of the whole tiny model takes
    minutes.)"""
    def passes(**options):
        dsflash_compile.compile(tiny_model(), max_batch=2, max_length=32, backend="eager", **options)
        manager = torch._inductor.config.post_grad_custom_post_pass
        return [(type(p).__name__, p.options.get("max_tokens")) for p in manager.passes]

    assert not CompileOptions().mhc_overlap and CompileOptions().mhc_overlap_max_tokens == 16  # off: 0.99x at B1
    rope = ("LinearRopePass", None), ("LinearScalePass", None), ("EarlyReadsPass", None)  # on by default, last
    assert passes(mhc_overlap=True, mhc_overlap_max_tokens=8, mhc_defer_mixes=False)[1:] == [
        ("MhcFusionPass", None), ("MhcOverlapPass", 8), *rope]
    assert passes(mhc_defer_mixes=False)[1:] == [("MhcFusionPass", None), *rope]
    with pytest.raises(ValueError, match="mhc_overlap_max_tokens"):
        CompileOptions(mhc_overlap_max_tokens=0)
    with pytest.raises(ValueError, match=f"fewer than {ROWS_MIN_TOKENS} tokens"):  # the rows kernel's seams
        CompileOptions(mhc_overlap=True, mhc_overlap_max_tokens=ROWS_MIN_TOKENS)


# -- on a GPU --------------------------------------------------------------------------------------

def teacher_forced(model, cache, ids, prompt):
    logits = [model(ids[:, :prompt], cache=cache, logits_to_keep=1).logits]
    return logits + [model(ids[:, t:t + 1], cache=cache).logits for t in range(prompt, ids.shape[1])]


def decode_runs(model, ids, pass_name, **options) -> tuple[list, int, list]:
    """The tiny model compiled with these options (2 rows, prefill chunks of 32, CUDA graphs): two teacher-forced
    runs of its logits (20 prompt columns, then decode), how many rewrites `pass_name` made (Inductor's caches
    off, so the passes run here) and the batch sizes of the decode graphs captured."""
    torch._dynamo.reset()
    dsflash_compile.compile(model, max_batch=2, max_length=64, batch_buckets=(2,), prefill_buckets=(32,), **options)
    runner = model.compiled_runner
    with graph_caches_off():
        runs = [teacher_forced(model, runner.fresh_cache(2, 64), ids, 20) for _ in range(2)]
    return runs, runner.pass_manager.matches.get(pass_name, 0), list(runner.graphs)


@requires_cuda
@torch.no_grad()
def test_cuda_graph_decode_same_bits_with_overlap_on_and_off(fresh_dynamo):  # noqa: F811
    """The captured decode graph (the side stream forked from and joined to the capturing stream) gives the
    same logits with overlap on as with it off (one fused launch per seam: the deferral of the mixes off too),
    replay after replay."""
    model = tiny_model().cuda()
    ids = prompts(2, 28).cuda()
    runs = {}
    for overlap in (True, False):
        runs[overlap], matches, graphs = decode_runs(model, ids, "mhc_overlap", mhc_overlap=overlap,
                                                     mhc_defer_mixes=False)
        assert graphs == [2]
        # prefill (2 x 32 tokens) stays fused; the decode graph's blocks (2 tokens) split both seams
        assert matches == (2 * distinct_roles(model) if overlap else 0)
    for a, b, c in zip(*runs[True], runs[False][0], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def kernel_streams(prof, path, name) -> set:
    """The CUDA streams the kernels named `name` ran on, from the profiler's Chrome trace."""
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    return {e["args"]["stream"] for e in events if e.get("cat") == "kernel" and e.get("name") == name}


@requires_cuda
@torch.no_grad()
def test_mixes_kernel_runs_on_another_stream(fresh_dynamo, tmp_path):  # noqa: F811
    """Compiled decode without graphs (kernels keep their launch stream in the profile): the seam kernel runs
    on two streams with overlap on, one with it off (the side stream is not used)."""
    from torch.profiler import ProfilerActivity, profile

    model = tiny_model().cuda()
    ids = prompts(2, 18).cuda()
    seen = {}
    for overlap in (True, False):
        torch._dynamo.reset()
        dsflash_compile.compile(model, max_batch=2, max_length=32, batch_buckets=(2,), prefill_buckets=(16,),
                                mhc_overlap=overlap, cuda_graphs=False)
        cache = model.compiled_runner.fresh_cache(2, 32)
        model(ids[:, :16], cache=cache, logits_to_keep=1)
        model(ids[:, 16:17], cache=cache)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(ids[:, 17:18], cache=cache)
            torch.cuda.synchronize()
        seen[overlap] = kernel_streams(prof, tmp_path / f"trace-{overlap}.json", "_seam_kernel")
    assert len(seen[True]) == 2 and len(seen[False]) == 1, seen


# -- the kernel's halves, under the interpreter and compiled for sm_90 ------------------------------

def interpreter_checks():
    """Entry point of the subprocess: the split launches against the one-launch seam, same bits (each case's
    launch for all of them)."""
    from dsflash_compile.custom_ops.mhc_triton import mhc_seam_triton

    for name, (lead, dim, launch) in KERNEL_CASES.items():
        out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args(lead, dim=dim)
        consts = (NORM_EPS, HC_EPS, ITERS)
        fused = mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, scale, base, weight, *consts, **launch)
        inputs = mhc_seam_triton(out, streams, post, comb, pre_lagged, None, None, None, weight, *consts, mixes=False,
                                 **launch)
        mixes = mhc_seam_triton(None, inputs[0], None, None, None, fn, scale, base, None, *consts, collapse=False,
                                **launch)
        entry = mhc_seam_triton(None, streams, None, None, pre_lagged, fn, scale, base, weight, *consts, **launch)
        entry_input = mhc_seam_triton(None, streams, None, None, pre_lagged, None, None, None, weight, *consts,
                                      mixes=False, **launch)
        entry_mixes = mhc_seam_triton(None, streams, None, None, None, fn, scale, base, None, *consts, collapse=False,
                                      **launch)
        report(dict(name=name, seam=[torch.equal(a, b) for a, b in zip(fused, inputs + mixes, strict=True)],
                    entry=[torch.equal(a, b) for a, b in zip(entry, entry_input + entry_mixes, strict=True)]))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_mhc_overlap", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_halves_equal_the_one_launch_seam(interpreted, name):
    assert all(interpreted[name]["seam"]) and all(interpreted[name]["entry"]), interpreted[name]


def test_kernel_halves_run_the_one_launch_binary():
    """The halves' switches are runtime arguments Triton never specializes (a 1 would be compiled apart), and no
    constexpr tells the launches apart (the ROUTE_ ones are fixed unless a routed seam routes; EARLY_FN and
    ROW_LOADS_FIRST come from the module for every launch): the split and the one launch run the same sm_90 code,
    so the same summation orders (as separate constexpr variants, the H200 gave them different bits at 16
    tokens)."""
    from dsflash_compile.custom_ops import mhc_triton

    kernel = mhc_triton._seam_kernel
    flags = {"has_post", "mixes", "collapse", "share_finish", "finish_mixes", "norm"}  # the last two: mhc_deferred.py
    assert {p.name for p in kernel.params if p.do_not_specialize} == flags
    assert {p.name for p in kernel.params if p.is_constexpr} == {"HC", "D", "BLOCK_D", "BLOCK_T", "PART",
                                                                 "CHUNKS_PAD", "NORM_BLOCK", "PDL", "ROUTE_TOPK",
                                                                 "ROUTE_K_PAD", "ROUTE_E_PAD", "ROUTE_NORMALIZE",
                                                                 "EARLY_FN", "ROW_LOADS_FIRST"}
