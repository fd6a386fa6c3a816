"""`dsflash::routed_experts` (custom_ops/routed_experts.py): the few-token routed experts as one op.

Its reference against MoE's own paths (the loop and the sorted grouped GEMMs); its Triton kernels under the
interpreter against the reference (bit for bit on data whose GEMMs are exact in fp32, so that only the
kernels' rounding points are tested; within the GEMMs' summation order on random data); compiled for sm_90
without spills; opcheck; its errors; and on a GPU at the release's sizes and inside a CUDA graph."""

import pytest
import torch
from dsflash_compile.custom_ops.routed_experts import routed_experts_reference
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.compiled import CompileOptions
from dsflash_compile.moe import MoE
from dsflash_compile.presets import preset_config
from dsflash_compile.quant import fp8_qdq

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (tokens, slots, experts, D, I, limit, quantize_x, quantize_h, shared folded, exact data); the last slot
# is the shared expert (id G - 1, weight 1) as MoE stacks it, passed as a slot or, folded, as shared_expert (the
# op adds its pair: MoE's call)
CASES = {
    "one_token": (1, 7, 9, 64, 64, 10.0, False, True, False, True),
    "one_token_folded": (1, 7, 9, 64, 64, 10.0, True, True, True, True),
    "elsewhere_pairs": (3, 4, 5, 96, 96, 0.5, True, True, True, True),  # ids -1 (another rank's experts) add nothing
    "no_clamp_no_fp8": (5, 3, 6, 64, 32, 0.0, False, False, False, True),
    # 32-row tile; D, I not multiples of the blocks
    "ragged_blocks": (17, 4, 9, 72, 160, 10.0, False, True, True, True),
    "most_tokens": (40, 3, 9, 64, 64, 10.0, True, True, True, True),  # 64-row tile, BLOCK_K 64
    "random_data": (3, 7, 9, 256, 128, 10.0, True, True, True, False),  # 3 tokens: interpreter time (CI)
}


def case_inputs(tokens, slots, experts, dim, inter, exact, seed=0, device="cpu"):
    """Routing: distinct experts per token, the shared one last. Exact data: values on a coarse grid, so that
    every GEMM sum is exact in fp32 and the kernels round where the reference does."""
    g = torch.Generator().manual_seed(seed)

    def values(*shape, div):
        if exact:
            return (torch.randint(-3, 4, shape, generator=g) / div).bfloat16()
        return (torch.randn(shape, generator=g) / div).bfloat16()

    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:slots - 1] for _ in range(tokens)])
    ids = torch.cat([ids, torch.full((tokens, 1), experts - 1)], 1)
    if tokens > 2:
        ids[1, 0] = ids[2, 1] = -1
    weights = torch.cat([torch.rand(tokens, slots - 1, generator=g), torch.ones(tokens, 1)], 1)
    x = values(tokens, dim, div=2)
    w1, w3 = values(experts, inter, dim, div=16), values(experts, inter, dim, div=16)
    w2 = values(experts, dim, inter, div=16)
    return tuple(t.to(device) for t in (x, weights, ids, w1, w3, w2))


def op_args(tokens, slots, experts, dim, inter, limit, quantize_x, quantize_h, folded, exact, device="cpu", seed=0):
    """One case's arguments of the op (kernels and reference alike)."""
    x, weights, ids, w1, w3, w2 = case_inputs(tokens, slots, experts, dim, inter, exact, seed=seed, device=device)
    if folded:
        weights, ids = weights[:, :-1].contiguous(), ids[:, :-1].contiguous()
    return x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, experts - 1 if folded else -1


def interpreter_checks():
    """Entry point of the subprocess: every case's kernels against the reference. On random data, also two
    kernel runs that must agree bit for bit: x quantized in the kernel against x quantized before it, and the
    shared expert folded against passed as a slot (with exact data the reference checks these, but the FP8 of
    x is then a no-op)."""
    from dsflash_compile.custom_ops.routed_experts_triton import by_expert_grid, routed_experts_triton

    kernel = {}  # each case's output, on the grid by_expert_grid picks
    for name, case in CASES.items():
        args = op_args(*case)
        got = kernel[name] = routed_experts_triton(*args)
        want = routed_experts_reference(*args)
        report(dict(name=name, same=torch.equal(got, want), err=((got - want).abs().max() / want.abs().max()).item()))
    x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared = op_args(*CASES["random_data"])
    got = kernel["random_data"]  # x quantized in the kernel
    assert quantize_x
    before = routed_experts_triton(fp8_qdq(x), weights, ids, w1, w3, w2, limit, False, quantize_h, shared)
    full = op_args(*CASES["random_data"][:8], False, False)
    slot = routed_experts_triton(*full)
    report(dict(name="x_quantized_in_the_kernel", same=torch.equal(got, before)))
    rounded = routed_experts_triton(x, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared, True)
    report(dict(name="bf16_out_is_the_fp32_sum_rounded", same=rounded.dtype == torch.bfloat16
                and torch.equal(rounded, got.bfloat16())))
    report(dict(name="shared_folded_or_a_slot", same=torch.equal(got, slot)))
    # the programs' rows by expert or by pair (by_expert_grid picks by expert above 16 tokens): the other grid
    # gives the same bits, also with pairs of ids -1
    same, picks = [], set()
    for name in ("random_data", "elsewhere_pairs", "most_tokens"):
        args = op_args(*CASES[name])
        slots = args[2].shape[1] + (args[-1] >= 0)
        picked = by_expert_grid(args[0].shape[0], args[3].shape[0], slots)
        picks.add(picked)
        same.append(torch.equal(routed_experts_triton(*args, by_expert=not picked), kernel[name]))
    assert picks == {True, False}  # the cases' own picks cover both grids
    report(dict(name="by_expert_or_by_pair", same=all(same)))
    # the up kernel's shared expert computed before its PDL wait (SHARED_FIRST: by pair, shared folded): same bits
    # (exact data; random_data's interpreter time is spared)
    cases = [name for name, case in CASES.items()
             if case[8] and case[9] and not by_expert_grid(case[0], case[2], case[1])]
    assert len(cases) >= 2
    report(dict(name="shared_first", same=all(
        torch.equal(routed_experts_triton(*op_args(*CASES[name]), shared_first=True), kernel[name]) for name in cases)))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_moe_small", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference(interpreted, name):
    result = interpreted[name]
    if CASES[name][-1]:
        assert result["same"], result
    else:  # a GEMM's other summation order can move a bf16 rounding, and an FP8 one after it
        assert result["err"] <= 2e-2, result


@requires_interpreter
@pytest.mark.parametrize("name", ["x_quantized_in_the_kernel", "shared_folded_or_a_slot", "by_expert_or_by_pair",
                                  "bf16_out_is_the_fp32_sum_rounded", "shared_first"])
def test_kernel_runs_that_must_agree(interpreted, name):
    assert interpreted[name]["same"], interpreted[name]


def tiny_moe(seed=0):
    config = preset_config("tiny").text_config
    torch.manual_seed(seed)
    moe = MoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return moe, config


@pytest.mark.parametrize("shared_stacked", [True, False])
@torch.no_grad()
def test_moe_few_tokens_equals_the_sorted_and_loop_paths(shared_stacked):
    """The MoE with few_tokens set (the op's reference on CPU) against its sorted grouped path and its loop:
    the same per-token order of terms, so only the GEMMs' rows differ (CPU bf16 GEMMs round alike here)."""
    moe, config = tiny_moe()
    x = torch.randn(5, 3, config.hidden_size).bfloat16()
    loop = moe(x)
    moe.ensure_grouped(shared_stacked)
    grouped = moe(x)
    moe.few_tokens = 15
    fused = moe(x)
    torch.testing.assert_close(fused, grouped, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(fused, loop, rtol=2e-2, atol=2e-3)
    moe.few_tokens = 14  # one token more than this: the sorted path
    assert torch.equal(moe(x), grouped)


def test_opcheck_and_errors():
    args = case_inputs(3, 4, 5, 64, 64, True)
    for flags in ((10.0, False, True, -1), (10.0, True, True, 4), (10.0, True, True, 4, True)):
        torch.library.opcheck(torch.ops.dsflash.routed_experts.default, (*args, *flags))
    assert torch.equal(torch.ops.dsflash.routed_experts(*args, 10.0, True, True, 4, True),
                       torch.ops.dsflash.routed_experts(*args, 10.0, True, True, 4).bfloat16())
    x, weights, ids, w1, w3, w2 = args
    op = torch.ops.dsflash.routed_experts
    with pytest.raises(TypeError, match="ids must be int64"):
        op(x, weights, ids.int(), w1, w3, w2, 10.0, True, True, -1)
    with pytest.raises(ValueError, match=r"w2 \[G, D, I\]"):
        op(x, weights, ids, w1, w3, w2[:, :32], 10.0, True, True, -1)
    with pytest.raises(ValueError, match="intermediate size .* multiple of the FP8 group"):
        op(x, weights, ids, w1[:, :48], w3[:, :48], w2[:, :, :48], 10.0, False, True, -1)
    with pytest.raises(ValueError, match="hidden size .* multiple of the FP8 group"):
        op(x[:, :48], weights, ids, w1[..., :48], w3[..., :48], w2[:, :48], 10.0, True, False, -1)
    with pytest.raises(ValueError, match="shared_expert=5 is not a slice of the 5 stacked"):
        op(x, weights, ids, w1, w3, w2, 10.0, True, True, 5)
    with pytest.raises(ValueError, match="moe_few_tokens=65"):
        CompileOptions(moe_few_tokens=65)


_UP = dict(x_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i64", w1_ptr="*bf16", w3_ptr="*bf16", h_ptr="*bf16",
           T="i32", KK="i32", SLOTS="i32", shared="i32", G="i32", I="i32", D="i32", limit="fp32")
_DOWN = dict(h_ptr="*bf16", ids_ptr="*i64", w2_ptr="*bf16", out_ptr="*bf16", y_ptr="*fp32", counter_ptr="*i32",
             T="i32", KK="i32", SLOTS="i32", shared="i32", G="i32", I="i32", D="i32")


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_kernels_compile_for_hopper_without_spills(block_m):
    """Each token tile's launches (routed_experts_triton.launches) at top-6 + shared, with the release's FP8 of x
    and h, the programs' rows as by_expert_grid picks them for flash-40l-e8 (9 stacked experts); the down
    kernel with an fp32 and a bf16 sum. Pointers, I and D specialized as multiples of 16, as the launch at the
    release's sizes specializes them (their cp.async pipelines then exist)."""
    from dsflash_compile.custom_ops import routed_experts_triton as module

    up, down = module.launches(block_m)
    by_expert = module.by_expert_grid(block_m, 9, 7)
    assert by_expert == (block_m > 16)
    ups = [("_up_kernel", _UP, up, dict(QUANT_X=True, QUANT_H=True, SHARED_FIRST=first))
           for first in ((False, True) if not by_expert else (False,))]  # SHARED_FIRST only by pair
    for name, arg_types, launch, extra in (*ups, ("_down_kernel", _DOWN, down, {}),
                                           ("_down_kernel", dict(_DOWN, y_ptr="*bf16"), down, {})):  # out_bf16
        constexprs = dict(BLOCK_M=block_m, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"], KK_PAD=8,
                          P_PAD=8 * block_m, G_PAD=16, BY_EXPERT=by_expert, FP32_DOT=False, **extra)
        pointers_and_sizes = [arg for arg in arg_types if arg.endswith("_ptr") or arg in ("I", "D")]
        check_compiles_for_hopper(module, (name, arg_types, constexprs, launch["num_warps"], launch["num_stages"]),
                                  divisible_by_16=pointers_and_sizes)  # as launched there


# ----------------------------------------------------------------------------------------------- CUDA


@requires_cuda
@pytest.mark.parametrize("tokens", [1, 4, 16, 33, 64])
def test_release_sizes_on_cuda(tokens):
    """D = 5120, I = 2304, 8 routed experts + the shared one (folded, as MoE calls it), top-6, x quantized in the
    op: the kernels against the reference on the GPU (cuBLAS there: other GEMM summation orders), replayed in a
    CUDA graph on new routing, and opcheck; the shared expert folded or as a slot, x quantized in the op or
    before it: the same bits."""
    case = (tokens, 7, 9, 5120, 2304, 10.0, True, True, True, False)
    args = op_args(*case, device="cuda")
    got = torch.ops.dsflash.routed_experts(*args)
    want = routed_experts_reference(*args)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 2e-2
    x, weights, ids, w1, w3, w2, limit, _, quantize_h, shared = args
    assert torch.equal(got, torch.ops.dsflash.routed_experts(fp8_qdq(x), weights, ids, w1, w3, w2, limit, False,
                                                             quantize_h, shared))
    assert torch.equal(got, torch.ops.dsflash.routed_experts(*op_args(*case[:8], False, False, device="cuda")))
    assert torch.equal(torch.ops.dsflash.routed_experts(*args, True), got.bfloat16())  # rounded once, as a cast
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dsflash.routed_experts(*args)
    args[2].copy_(op_args(*case, device="cuda", seed=1)[2])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, torch.ops.dsflash.routed_experts(*args))
    torch.library.opcheck(torch.ops.dsflash.routed_experts.default, args)


@requires_cuda
@pytest.mark.parametrize("tokens", [1, 4])
def test_shared_first_after_the_router_in_a_cuda_graph(tokens):
    """The up kernel's shared expert before its PDL wait (SHARED_FIRST), as MoE runs it at decode: x written by
    a kernel, the router's launch, then the op, in a CUDA graph replayed on new x: the bits of the default
    kernels run eagerly."""
    from dsflash_compile.custom_ops.routed_experts_triton import routed_experts_triton

    case = (tokens, 7, 9, 5120, 2304, 10.0, True, True, True, False)
    x, _, _, w1, w3, w2, limit, quantize_x, quantize_h, shared = op_args(*case, device="cuda")
    gate = (torch.randn(8, 5120, device="cuda") / 64).bfloat16()
    bias = torch.zeros(8, device="cuda")
    source = x.clone()

    def moe(first):
        y = source * 1.5  # a kernel writing x, two launches before the up kernel
        weights, ids = torch.ops.dsflash.fused_router(y, gate, bias, 6, True, 1.0)
        return routed_experts_triton(y, weights, ids, w1, w3, w2, limit, quantize_x, quantize_h, shared,
                                     shared_first=first)

    want = moe(False)
    assert torch.equal(moe(True), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe(True)
    source.copy_(op_args(*case, device="cuda", seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, moe(False))
    assert not torch.equal(captured, want)
