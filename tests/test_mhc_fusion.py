"""The mHC seam ops (custom_ops/mhc.py), their Triton kernel under the interpreter (custom_ops/mhc_triton.py)
and the fusion pass (passes/mhc_fusion.py) in compiled seams and in the tiny model's layer loop."""

import inspect

import pytest
import torch
from torch import nn
from torch._inductor import config as inductor_config

from dsflash_compile import DeepseekV41ForCausalLM, passes, preset_config
from dsflash_compile.custom_ops.mhc import ROWS_MIN_TOKENS, entry_seam_reference, seam_reference
from dsflash_compile.layers import RMSNorm
from dsflash_compile.modeling_deepseek_v41 import DeepseekV41Block
from dsflash_compile.mhc import PendingPost, expanded, hc_mixes, hc_post, hc_pre
from dsflash_compile.passes import MhcFusionPass
from dsflash_compile.passes.mhc_fusion import trace_like_post_grad
from graph_caches import graph_caches_off
from interp import report, run_interpreted, requires_interpreter
from hopper import check_compiles_for_hopper, compile_for_hopper

NORM_EPS, HC_EPS, ITERS = 1e-20, 1e-6, 20  # the tiny preset's (and the release's)
EPS32 = torch.finfo(torch.float32).eps
SEAM_OPS = ("dsflash.mhc_seam.default", "dsflash.mhc_entry_seam.default")


def seam_args(lead, hc=4, dim=64, seed=0):
    """(out, streams, post, comb, pre_lagged, fn, scale, base, norm_weight), random and never zero."""
    g = torch.Generator().manual_seed(seed)
    mix = (2 + hc) * hc
    return (torch.randn(*lead, dim, generator=g).bfloat16(), torch.randn(*lead, hc, dim, generator=g).bfloat16(),
            2 * torch.rand(*lead, hc, generator=g), torch.rand(*lead, hc, hc, generator=g),
            torch.rand(*lead, hc, generator=g) + 0.5, torch.randn(mix, hc * dim, generator=g) * 0.05,
            torch.rand(3, generator=g) + 0.5, torch.randn(mix, generator=g) * 0.5,
            (torch.rand(dim, generator=g) + 0.5).bfloat16())


# -- the ops ---------------------------------------------------------------------------------------

def test_seam_ops_equal_the_model_functions():
    """mhc_seam = hc_post, then hc_mixes, hc_pre and the model's RMSNorm module; mhc_entry_seam without hc_post."""
    out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args((2, 3))
    norm = RMSNorm(weight.shape[0], NORM_EPS)
    norm.weight.data = weight
    new = hc_post(out, streams, post, comb)
    want = (new, norm(hc_pre(new, pre_lagged)), *hc_mixes(new, fn, scale, base, NORM_EPS, HC_EPS, ITERS))
    got = torch.ops.dsflash.mhc_seam(out, streams, post, comb, pre_lagged, fn, scale, base, weight, NORM_EPS,
                                     HC_EPS, ITERS)
    entry = torch.ops.dsflash.mhc_entry_seam(new, pre_lagged, fn, scale, base, weight, NORM_EPS, HC_EPS, ITERS)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip(entry, want[1:]))


def test_seam_ops_opcheck():
    args = seam_args((3,))
    torch.library.opcheck(torch.ops.dsflash.mhc_seam.default, (*args, NORM_EPS, HC_EPS, ITERS))
    torch.library.opcheck(torch.ops.dsflash.mhc_entry_seam.default, (*args[1:2], *args[4:], NORM_EPS, HC_EPS, ITERS))


def test_seam_op_names_a_wrong_shape():
    out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args((2,))
    with pytest.raises(ValueError, match="fn has shape"):
        torch.ops.dsflash.mhc_seam(out, streams, post, comb, pre_lagged, fn[:, :-1], scale, base, weight, NORM_EPS,
                                   HC_EPS, ITERS)


# -- the Triton kernel, under the interpreter ------------------------------------------------------

KERNEL_CASES = {  # name: (leading dims, D, launch); D = 96 leaves a partial chunk, 20 tokens take the wide
    # D chunk (one partial chunk here); "token_blocks": several tokens per program, a short last block
    "decode": ((1,), 64, {}),
    "batch_seq": ((2, 3), 96, {}),
    "prefill": ((20,), 64, {}),
    "token_blocks": ((7,), 96, {"block_t": 4, "block_d": 32}),
}
ROWS_CASES = {  # name: (leading dims, D, rows_launch): mhc_rows_triton's kernel, forced below ROWS_MIN_TOKENS;
    # each leaves a partial last block of tokens, D = 96 a partial chunk at the default 64 columns
    # (one split: the kernel without partials; the default launch splits D)
    "rows_prefill": ((37,), 96, {"splits": 1}),
    "rows_batch_seq": ((2, 19), 64, {"block_t": 32, "block_d": 32}),
    "rows_short": ((20,), 96, {"block_d": 32, "num_warps": 8, "splits": 1}),
    # D splits: a short last split with a partial chunk; split_plan's default (4 splits of one chunk); 10
    # splits (a padded load of partials in the finish); a finish that normalises a row in several tiles
    "rows_split": ((37,), 80, {"block_d": 32, "splits": 2}),
    "rows_split_default": ((20,), 64, {"block_d": 16, "splits": None}),
    "rows_split_groups": ((2, 9), 160, {"block_d": 16, "splits": 10}),
    "rows_norm_tiles": ((19,), 96, {"finish_norm_block": 32, "finish_warps": 1}),
    "rows_finish_whole": ((21,), 96, {"block_d": 32, "finish_split": False}),
}


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of the last place of bf16 at want."""
    _, exponent = torch.frexp(want.float())
    return ((got.float() - want.float()).abs() / torch.exp2(exponent.float() - 8)).max().item()


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    _, exponent = torch.frexp(x)
    return torch.exp2(exponent.double() - 8)


def post_error_ratio(got, out, streams, post, comb) -> float:
    """Largest |got - Y| over its bound, for new streams Y = post * out + sum_i comb_i * X_i: half a bf16 ulp
    (the cast) plus 8 fp32 epsilons of the terms' absolute sum (the sum's order). Where the five terms cancel
    near zero, bf16_ulps between two fp32 sums in different orders is large (7 at 64 release-size tokens)."""
    terms = torch.cat([(post.double().unsqueeze(-1) * out.double().unsqueeze(-2)).unsqueeze(-3),
                       comb.double().unsqueeze(-1) * streams.double().unsqueeze(-2)], dim=-3)
    exact = terms.sum(-3)
    bound = _bf16_ulp(torch.maximum(exact.abs(), got.double().abs())) / 2 + 8 * EPS32 * terms.abs().sum(-3)
    return ((got.double() - exact).abs() / bound).max().item()


def normed_error_ratio(got, streams, pre_lagged, weight, eps) -> float:
    """The same for normed = w * x * rsqrt(mean(x^2) + eps), x = bf16(sum_i p_i * X_i): two bf16 ulps of normed
    (its cast, the statistic's order) plus x's bound (half an ulp, 8 fp32 epsilons of the collapse's absolute
    sum) carried through w * rsqrt. Where the collapse cancels, bf16_ulps reached 153 at 300 tokens."""
    terms = pre_lagged.double().unsqueeze(-1) * streams.double()
    x = terms.sum(-2)
    scale = weight.double() * torch.rsqrt(x.bfloat16().double().square().mean(-1, keepdim=True) + eps)
    exact = scale * x
    bound = (2 * _bf16_ulp(torch.maximum(exact.abs(), got.double().abs()))
             + scale.abs() * (_bf16_ulp(x.abs()) / 2 + 8 * EPS32 * terms.abs().sum(-2)))
    return ((got.double() - exact).abs() / bound).max().item()


def interpreter_checks():
    """Entry point of the subprocess: kernel vs reference. The new streams against the reference's; the
    rest against the reference applied to the kernel's own new streams (so one truncated bf16 cast of the
    interpreter does not move the mixes), and the entry variant directly. The one-launch kernel twice: its
    counters reset (the rows kernels keep no state, so once)."""
    from dsflash_compile.custom_ops.mhc_triton import mhc_seam_triton

    cases = [(name, lead, dim, launch) for name, (lead, dim, launch) in KERNEL_CASES.items()]
    cases += [(name, lead, dim, {"rows": True, "rows_launch": launch})
              for name, (lead, dim, launch) in ROWS_CASES.items()]
    for name, lead, dim, launch in cases:
        out, streams, post, comb, pre_lagged, *params = seam_args(lead, dim=dim)
        got = mhc_seam_triton(out, streams, post, comb, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS, **launch)
        want_new = seam_reference(out, streams, post, comb, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS)[0]
        want = entry_seam_reference(got[0], pre_lagged, *params, NORM_EPS, HC_EPS, ITERS)
        entry = mhc_seam_triton(None, streams, None, None, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS, **launch)
        want_entry = entry_seam_reference(streams, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS)
        result = dict(name=name, streams_ulps=bf16_ulps(got[0], want_new), normed_ulps=bf16_ulps(got[1], want[0]),
                      mixes_err=max((g - w).abs().max().item() for g, w in zip(got[2:], want[1:])),
                      entry_normed_ulps=bf16_ulps(entry[0], want_entry[0]),
                      entry_mixes_err=max((g - w).abs().max().item() for g, w in zip(entry[1:], want_entry[1:])))
        if not launch.get("rows"):  # the one-launch kernel again: its counters were reset
            again = mhc_seam_triton(out, streams, post, comb, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS, **launch)
            result["repeatable"] = all(torch.equal(a, b) for a, b in zip(got, again))
        if name in ("decode", "token_blocks"):  # the loads reordered (EARLY_FN, ROW_LOADS_FIRST): the same bits
            early = dict(launch, early_fn=True, row_loads_first=True)
            result["reordered_same"] = all(torch.equal(a, b) for a, b in zip(got, mhc_seam_triton(
                out, streams, post, comb, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS, **early))) and all(
                torch.equal(a, b) for a, b in zip(entry, mhc_seam_triton(
                    None, streams, None, None, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS, **early)))
        report(result)


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_mhc_fusion", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", [*KERNEL_CASES, *ROWS_CASES])
def test_seam_kernel_matches_reference(interpreted, name):
    """bf16 outputs within 3 ulps (the interpreter truncates where the GPU rounds, twice on the way to the
    normed output; sums run in another order), fp32 mixes within 2e-6."""
    r = interpreted[name]
    assert name in ROWS_CASES or r["repeatable"], r  # a second one-launch run (the rows kernels keep no state)
    assert r.get("reordered_same", True), r
    assert max(r["streams_ulps"], r["normed_ulps"], r["entry_normed_ulps"]) <= 3, r
    assert max(r["mixes_err"], r["entry_mixes_err"]) <= 2e-6, r


KERNEL_ARGS = dict(out_ptr="*bf16", streams_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", pre_lag_ptr="*fp32",
                   fn_ptr="*fp32", scale_ptr="*fp32", base_ptr="*fp32", weight_ptr="*bf16", new_streams_ptr="*bf16",
                   normed_ptr="*bf16", pre_out_ptr="*fp32", post_out_ptr="*fp32", comb_out_ptr="*fp32",
                   partial_ptr="*fp32", counter_ptr="*i32", N="i32", norm_eps="fp32", hc_eps="fp32", iters="i32",
                   has_post="i32", mixes="i32", collapse="i32", share_finish="i32", finish_mixes="i32", norm="i32",
                   gate_ptr="*bf16", gate_bias_ptr="*fp32", route_weights_ptr="*fp32", route_ids_ptr="*i64",
                   experts="i32", route_scale="fp32")
# the seam's launches without routing (custom_ops/mhc_deferred.py's routed seam sets them)
NO_ROUTE = dict(ROUTE_TOPK=0, ROUTE_K_PAD=1, ROUTE_E_PAD=1, ROUTE_NORMALIZE=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_seam_kernel_on_cuda_two_finishing_programs_give_one_programs_bits(tokens):
    """On CUDA two programs finish a block (the Sinkhorn and the RMSNorm side by side; the interpreter runs one):
    the same bits as one finishing program, again on a second call (the counters reset), and the reference's
    values (bf16 outputs within post_error_ratio's and normed_error_ratio's bounds; the mixes within
    bench_mhc's 1e-5, the sums of the release's 20480 products running in another order)."""
    from dsflash_compile.custom_ops.mhc_triton import mhc_seam_triton

    out, streams, post, comb, pre_lagged, *params = (t.cuda() for t in seam_args((tokens,), dim=5120))
    args = (out, streams, post, comb, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS)
    shared = [mhc_seam_triton(*args, share_finish=True) for _ in range(2)]
    single = mhc_seam_triton(*args, share_finish=False)
    for got in (shared[1], single):
        assert all(torch.equal(a, b) for a, b in zip(shared[0], got, strict=True))
    want = entry_seam_reference(shared[0][0], pre_lagged, *params, NORM_EPS, HC_EPS, ITERS)
    assert post_error_ratio(shared[0][0], out, streams, post, comb) <= 1
    assert normed_error_ratio(shared[0][1], shared[0][0], pre_lagged, params[-1], NORM_EPS) <= 1
    assert max((g - w).abs().max().item() for g, w in zip(shared[0][2:], want[1:])) <= 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 16])
def test_seam_kernel_on_cuda_with_its_loads_reordered(tokens):
    """EARLY_FN and ROW_LOADS_FIRST (the fn tile before the PDL wait, the row's loads together), full and entry
    seams and the deferred seam's partials: within the default kernel's bounds against the reference (another
    binary: sm_90 may lay its sums out otherwise), the same outputs twice, and in a CUDA graph on new streams."""
    from dsflash_compile.custom_ops.mhc_triton import mhc_seam_triton

    out, streams, post, comb, pre_lagged, *params = (t.cuda() for t in seam_args((tokens,), dim=5120))
    args = (out, streams, post, comb, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS)
    early = dict(early_fn=True, row_loads_first=True, rows=False)
    got = mhc_seam_triton(*args, **early)
    assert all(torch.equal(a, b) for a, b in zip(got, mhc_seam_triton(*args, **early), strict=True))
    want = entry_seam_reference(got[0], pre_lagged, *params, NORM_EPS, HC_EPS, ITERS)
    assert post_error_ratio(got[0], out, streams, post, comb) <= 1
    assert normed_error_ratio(got[1], got[0], pre_lagged, params[-1], NORM_EPS) <= 1
    assert max((g - w).abs().max().item() for g, w in zip(got[2:], want[1:])) <= 1e-5
    entry = mhc_seam_triton(None, streams, None, None, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS, **early)
    want = entry_seam_reference(streams, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS)
    assert max((g - w).abs().max().item() for g, w in zip(entry[1:], want[1:])) <= 1e-5
    partials = mhc_seam_triton(*args, finish_mixes=False, norm=False, **early)
    default = mhc_seam_triton(*args, finish_mixes=False, norm=False, early_fn=False, row_loads_first=False,
                              rows=False)
    assert torch.equal(partials[0], default[0])  # the new streams: no sum across threads
    assert (partials[2] - default[2]).abs().max().item() <= 1e-5 * default[2].abs().max().item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mhc_seam_triton(*args, **early)
    streams.copy_(seam_args((tokens,), dim=5120, seed=1)[1].cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, mhc_seam_triton(*args, **early), strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [ROWS_MIN_TOKENS, 64, 300])
def test_rows_kernels_on_cuda(tokens):
    """Release dims on CUDA, the rows kernels' default launch (D splits, the split finish): the same bits as
    the finish in one program a token and again inside a CUDA graph replayed on new streams; the reference's
    values within the bounds of the one-token kernel's CUDA test."""
    from dsflash_compile.custom_ops.mhc_triton import mhc_seam_triton

    out, streams, post, comb, pre_lagged, *params = (t.cuda() for t in seam_args((tokens,), dim=5120))
    args = (out, streams, post, comb, pre_lagged, *params, NORM_EPS, HC_EPS, ITERS)
    got = mhc_seam_triton(*args, rows=True)
    whole = mhc_seam_triton(*args, rows=True, rows_launch={"finish_split": False})
    assert all(torch.equal(a, b) for a, b in zip(got, whole, strict=True))
    want = entry_seam_reference(got[0], pre_lagged, *params, NORM_EPS, HC_EPS, ITERS)
    assert post_error_ratio(got[0], out, streams, post, comb) <= 1
    assert normed_error_ratio(got[1], got[0], pre_lagged, params[-1], NORM_EPS) <= 1
    assert max((g - w).abs().max().item() for g, w in zip(got[2:], want[1:])) <= 1e-5
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mhc_seam_triton(*args, rows=True)
    streams.copy_(seam_args((tokens,), dim=5120, seed=1)[1].cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, mhc_seam_triton(*args, rows=True), strict=True))


@pytest.mark.parametrize("block_t, block_d, early_fn", [(1, 64, False), (1, 64, True), (1, 128, False),
                                                       (16, 64, False)])
def test_seam_kernel_compiles_for_hopper(block_t, block_d, early_fn):
    """Release dims (hc 4, D 5120), the default launches (decode, wider chunks) and a token block: sm_90
    code, no spills (one binary for both ops and the split halves: their flags are runtime arguments). With
    EARLY_FN the fn tile's loads, and no other global access, come before the PDL wait."""
    from dsflash_compile.custom_ops import mhc_triton

    constexprs = dict(HC=4, D=5120, BLOCK_D=block_d, BLOCK_T=block_t, PART=32, CHUNKS_PAD=128,
                      NORM_BLOCK=mhc_triton.NORM_BLOCK, EARLY_FN=early_fn, ROW_LOADS_FIRST=early_fn, **NO_ROUTE)
    pointers = [arg for arg in KERNEL_ARGS if arg.endswith("_ptr")]
    spec = ("_seam_kernel", KERNEL_ARGS, constexprs, 4)
    check_compiles_for_hopper(mhc_triton, spec, divisible_by_16=pointers)
    ptx = compile_for_hopper(mhc_triton, spec, divisible_by_16=pointers).asm["ptx"]
    before = ptx[:ptx.index("griddepcontrol.wait")]
    assert ("ld.global" in before) == early_fn and "st.global" not in before and "atom" not in before


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("has_post", [True, False])
def test_rows_kernels_compile_for_hopper(has_post, split):
    """Release dims, the rows kernels' default launch with one D split and with several, both ops, and the
    per-token finish: sm_90 code without spills. The pointers (and the columns per split, a multiple of
    BLOCK_D) are 16-byte aligned, as torch allocates them and as Triton specializes the launch (vectorised,
    pipelined loads); unaligned ones would compile another variant."""
    from dsflash_compile.custom_ops import mhc_rows_triton

    launch = mhc_rows_triton.LAUNCH
    constexprs = dict(HC=4, D=5120, BLOCK_T=launch["block_t"], BLOCK_D=launch["block_d"], MIX_PAD=32,
                      HAS_POST=has_post, PRECISION=launch["precision"], SPLIT=split)
    args = {name: KERNEL_ARGS.get(name, "i32") for name in mhc_rows_triton._seam_rows_kernel.arg_names
            if name not in constexprs}  # span: i32
    finish_constexprs = dict(HC=4, D=5120, MIX_PAD=32, SPLITS_PAD=64 if split else 1,
                             NORM_BLOCK=launch["finish_norm_block"])
    finish_args = {name: KERNEL_ARGS.get(name, "i32") for name in mhc_rows_triton._finish_rows_kernel.arg_names
                   if name not in finish_constexprs}  # splits: i32
    check_compiles_for_hopper(mhc_rows_triton, ("_seam_rows_kernel", args, constexprs, launch["num_warps"]),
                              divisible_by_16=[name for name, kind in args.items() if kind.startswith("*")]
                              + ["span"])
    check_compiles_for_hopper(mhc_rows_triton, ("_finish_rows_kernel", finish_args, finish_constexprs,
                                                launch["finish_warps"]),
                              divisible_by_16=[name for name, kind in finish_args.items() if kind.startswith("*")])


def test_rows_split_plan(monkeypatch):
    """D splits from the shapes (release D: 80 chunks of 64): about TARGET_PROGRAMS programs by default, whole
    chunks per split and none left empty, one split once the token blocks fill the GPU."""
    from dsflash_compile.custom_ops import mhc_rows_triton
    from dsflash_compile.custom_ops.mhc_rows_triton import LAUNCH, split_plan

    monkeypatch.setattr(mhc_rows_triton, "TARGET_PROGRAMS", 264)
    auto = {**LAUNCH, "splits": None}
    assert split_plan(64, 5120, auto) == (4, 40, 128)  # 66 wanted: 2 chunks each
    assert split_plan(128, 5120, auto) == (8, 27, 192)
    assert split_plan(1024, 5120, auto) == (64, 4, 1280)
    assert split_plan(4096, 5120, auto) == (256, 1, 5120)
    assert split_plan(64, 5120, {**LAUNCH, "splits": 1}) == (4, 1, 5120)
    assert split_plan(64, 5120, {**LAUNCH, "splits": 64}) == (4, 40, 128)
    assert split_plan(64, 96, {**LAUNCH, "splits": 8}) == (4, 2, 64)


class RecordedKernel:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **constexprs) appends (name, grid, constexprs)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.calls.append((self.name, grid, constexprs))


def test_full_seams_of_many_tokens_take_the_rows_kernel(monkeypatch):
    """mhc_seam_triton's dispatch (host code; the launches recorded, not run): full seams from ROWS_MIN_TOKENS
    tokens take the rows kernel, a program per (block of tokens, D split), then its finish, a program per
    token; fewer tokens and the split launches (mixes
    or collapse off: they must equal _seam_kernel's one launch) take _seam_kernel."""
    pytest.importorskip("triton")
    from dsflash_compile.custom_ops import mhc_rows_triton, mhc_triton
    from dsflash_compile.custom_ops.mhc_triton import mhc_seam_triton

    calls = []
    monkeypatch.setattr(mhc_triton, "_seam_kernel", RecordedKernel("seam", calls))
    monkeypatch.setattr(mhc_rows_triton, "_seam_rows_kernel", RecordedKernel("rows", calls))
    monkeypatch.setattr(mhc_rows_triton, "_finish_rows_kernel", RecordedKernel("finish", calls))
    monkeypatch.setitem(mhc_rows_triton.LAUNCH, "splits", None)  # split_plan's automatic splits (pinned)
    block_t = mhc_rows_triton.LAUNCH["block_t"]
    least = ROWS_MIN_TOKENS
    dim = 1024  # 16 chunks of 64 to split
    seen_splits = set()
    # the last count fills TARGET_PROGRAMS programs with token blocks alone: no split
    for tokens in (1, least - 1, least, mhc_rows_triton.TARGET_PROGRAMS * block_t + 3):
        out, streams, post, comb, pre_lagged, fn, scale, base, weight = seam_args((tokens,), dim=dim)
        consts = (NORM_EPS, HC_EPS, ITERS)
        calls.clear()
        mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, scale, base, weight, *consts)
        mhc_seam_triton(None, streams, None, None, pre_lagged, fn, scale, base, weight, *consts)
        mhc_seam_triton(out, streams, post, comb, pre_lagged, None, None, None, weight, *consts, mixes=False)
        mhc_seam_triton(None, streams, None, None, None, fn, scale, base, None, *consts, collapse=False)
        full = ["rows", "finish"] if tokens >= least else ["seam"]
        assert [name for name, _, _ in calls] == [*full, *full, "seam", "seam"], tokens
        if tokens >= least:  # (token blocks, D splits) as split_plan says: several where the blocks are few
            blocks, splits, _ = mhc_rows_triton.split_plan(tokens, dim, mhc_rows_triton.LAUNCH)
            assert blocks == (tokens + block_t - 1) // block_t
            rows, finishes = calls[0:4:2], calls[1:4:2]
            assert [grid for _, grid, _ in rows] == [(blocks, splits)] * 2
            split_finish = 2 if mhc_rows_triton.LAUNCH["finish_split"] else 1  # the mixes and the RMSNorm apart
            assert [grid for _, grid, _ in finishes] == [(tokens, split_finish)] * 2
            assert [constexprs["SPLIT"] for _, _, constexprs in rows] == [splits > 1] * 2
            seen_splits.add(splits > 1)
            assert [constexprs["HAS_POST"] for _, _, constexprs in rows] == [True, False]
    assert seen_splits == {True, False}
    with pytest.raises(ValueError, match="full seams only"):
        mhc_seam_triton(out, streams, post, comb, pre_lagged, None, None, None, weight, *consts, mixes=False, rows=True)
    with pytest.raises(ValueError, match="block_t=8"):
        mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, scale, base, weight, *consts, rows=True,
                        rows_launch={"block_t": 8})
    with pytest.raises(ValueError, match="unknown launch keys"):
        mhc_seam_triton(out, streams, post, comb, pre_lagged, fn, scale, base, weight, *consts, rows=True,
                        rows_launch={"warps": 8})


# -- the pass --------------------------------------------------------------------------------------

class Seams:
    """A post-grad pass that runs the mHC pass and counts the fused op calls it leaves in the graph."""

    def __init__(self, norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS):
        self.fusion = MhcFusionPass(norm_eps, hc_eps, iters)
        self.matches, self.ops = [], []

    def __call__(self, graph):
        self.matches.append(self.fusion.apply(graph))
        self.ops.append({op: sum(str(n.target) == op for n in graph.nodes) for op in SEAM_OPS})


@pytest.fixture
def compiling():
    """`compile_with(seams, fn)`: fn compiled with `seams` as the post-grad pass, for inference (no
    intermediates saved for a backward) and with Inductor's caches off (a hit would skip the pass)."""
    torch._dynamo.reset()

    def compile_with(seams, fn):
        passes.use(seams)
        return torch.compile(fn, fullgraph=True)

    with torch.no_grad(), graph_caches_off(
            post_grad_custom_post_pass=inductor_config.post_grad_custom_post_pass,
            online_softmax=inductor_config.online_softmax,
            emulate_precision_casts=inductor_config.emulate_precision_casts):
        yield compile_with
    torch._dynamo.reset()


def one_seam(norm):
    def seam(out, streams, post, comb, pre_lagged, fn, scale, base):
        new = hc_post(out, streams, post, comb)
        pre, post, comb = hc_mixes(new, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
        return new * 2, norm(hc_pre(new, pre_lagged)) * 2, pre * 2, post * 2, comb * 2
    return seam


def test_one_seam_becomes_one_op(compiling):
    """A decode token [1, 1, hc, D], then 2 x 3 tokens (the recompile with dynamic batch and sequence), then
    7 flattened tokens [7, hc, D]: one mhc_seam each time, nothing left over, the same values."""
    norm = RMSNorm(64, NORM_EPS)
    seams = Seams()
    compiled = compiling(seams, one_seam(norm))
    for lead in ((1, 1), (2, 3), (7,)):
        args = seam_args(lead)
        norm.weight.data = args[-1]
        for g, w in zip(compiled(*args[:-1]), one_seam(norm)(*args[:-1])):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert seams.matches == [1, 1, 1] and seams.ops == [{SEAM_OPS[0]: 1, SEAM_OPS[1]: 0}] * 3


@pytest.mark.parametrize("constants", [(1e-6, HC_EPS, ITERS), (NORM_EPS, 1e-5, ITERS)])
def test_seam_with_other_constants_is_left_alone(constants):
    """Eps constants are exact in the patterns: a pass built for other ones leaves the seam's graph (traced
    as Inductor's post-grad graph looks) as it is, so it stays correct. (A pass for fewer Sinkhorn rounds
    does match, taking the seam up to that round; the remaining rounds then run after the op, also right.)"""
    graph = trace_like_post_grad(one_seam(RMSNorm(64, NORM_EPS)), seam_args((2, 3))[:-1]).graph
    nodes = len(graph.nodes)
    assert MhcFusionPass(*constants).apply(graph) == 0 and len(graph.nodes) == nodes


class StandIn(nn.Module):
    """Cheap stand-in for attention / MoE: the seams, not the sublayers, are under test. Called as the
    block calls attention (x, ctx, layer cache, top-k) it returns (out, top-k), as it calls the MoE (x): out."""

    def forward(self, x, *context):
        out = (torch.tanh(x.float()) * 0.5).to(x.dtype)
        return (out, None) if len(context) > 1 else out


def block_context() -> list:
    """The block's required context arguments (attention context, layer cache) as Nones: only the stand-ins
    see them."""
    return [None] * sum(p.default is p.empty for p in inspect.signature(DeepseekV41Block.forward).parameters.values()
                        if p.name not in ("self", "streams", "pre_mix"))


def tiny_layer_loop(layers=None, seed=0):
    """(layer_loop, inputs): the tiny model's layer loop (DeepseekV41Model.run: Engram where configured, then
    each block, then the final collapse and norm) over its first `layers` blocks (None: all) with attention
    and MoE stood in for, and inputs(batch, seq) -> its arguments."""
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(preset_config("tiny")).eval().model
    for block in model.layers:
        block.attn, block.ffn = StandIn(), StandIn()
    context = block_context()

    def layer_loop(ids, hash_ids):
        streams = model.embed(ids).unsqueeze(2).repeat(1, 1, model.hc, 1)
        pre_mix = torch.nn.functional.one_hot(torch.zeros_like(ids), model.hc).float()
        for block in model.layers[:layers]:
            if block.engram is not None:
                streams = block.engram(streams, hash_ids)
            streams, pre_mix = block(streams, pre_mix, *context)[:2]
        return model.norm(hc_pre(expanded(streams), pre_mix))

    def inputs(batch, seq):
        rows = min(block.engram.embed.weight.shape[0] for block in model.layers if block.engram is not None)
        return torch.randint(0, 512, (batch, seq)), torch.randint(0, rows, (batch, seq, 6))

    return layer_loop, inputs


def test_every_seam_of_the_tiny_model_is_fused(compiling):
    """The tiny model's layer loop at batch 2 x 3 tokens: 9 layers x 2 seams = 18 fused seams. Block 0's
    attention seam and the two after Engram (layers 1 and 2) are entry seams; the other 15 also fuse the
    previous sublayer's hc_post. The hc_post in front of Engram and the final collapse + norm stay Inductor's."""
    layer_loop, inputs = tiny_layer_loop()
    seams = Seams()
    args = inputs(2, 3)
    torch.testing.assert_close(compiling(seams, layer_loop)(*args), layer_loop(*args), rtol=2 ** -6, atol=2 ** -6)
    assert seams.matches == [18]
    assert seams.ops == [{SEAM_OPS[0]: 15, SEAM_OPS[1]: 3}]


@pytest.mark.parametrize("handed", ["pending", "expanded"])
@pytest.mark.parametrize("which", ["middle", "last"])
def test_a_block_compiled_alone_fuses_the_expansion_it_is_handed(compiling, handed, which):
    """Blocks compile one by one (compile() compiles each). Handed the block before's PendingPost, a block's graph
    starts with that expansion, so both its seams become full mhc_seam ops; handed expanded streams (block 0,
    after Engram), its first seam is an entry seam. A block returns its MoE output as a PendingPost, the last
    block expanded; the same values as uncompiled."""
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(preset_config("tiny")).eval().model
    block = model.layers[4] if which == "middle" else model.layers[-1]
    assert block.engram is None and block.last == (which == "last")
    block.attn, block.ffn = StandIn(), StandIn()
    context = block_context()
    out, streams, post, comb, pre_mix = seam_args((2, 3), hc=model.hc, dim=256)[:5]
    given = PendingPost(out, streams, post, comb) if handed == "pending" else streams

    def run(given, pre_mix):
        return block(given, pre_mix, *context)[:2]

    seams = Seams()
    got, want = compiling(seams, run)(given, pre_mix), run(given, pre_mix)
    assert isinstance(got[0], torch.Tensor if which == "last" else PendingPost)
    flat = [*got[0], got[1]] if which == "middle" else list(got)
    for g, w in zip(flat, [*want[0], want[1]] if which == "middle" else list(want)):
        torch.testing.assert_close(g, w, rtol=2 ** -6, atol=2 ** -6)
    full = 2 if handed == "pending" else 1
    assert seams.ops == [{SEAM_OPS[0]: full, SEAM_OPS[1]: 2 - full}]
