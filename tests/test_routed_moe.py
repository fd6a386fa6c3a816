"""`dsflash::routed_moe` (custom_ops/routed_moe.py): the router and the few-token routed experts as one op, the
shared expert's up projection launched beside the router.

Its Triton launches under the interpreter against the two ops' kernels run one after the other (one program a
column block of the shared expert: the same bits, the same code computes every value) and, with D split, against
the reference; compiled for sm_90 without spills; opcheck and its
fallbacks; on a GPU at the release's sizes, inside a CUDA graph."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_moe_small import op_args
from test_router_triton import router_case

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SCALE = 1.5
# name: (tokens, routed experts, D, I, top-k, quantize_x, out_bf16); the shared expert is stacked last
CASES = {
    "one_token": (1, 8, 256, 64, 6, True, True),
    "three_tokens_fp32_sum": (3, 8, 256, 128, 6, True, False),
    "ragged": (13, 12, 200, 96, 2, False, True),  # D, I not multiples of the blocks
    "most_tokens": (16, 8, 128, 64, 6, True, True),  # the launches' MAX_TOKENS
}


def case_args(tokens, experts, dim, inter, topk, quantize_x, out_bf16, device="cpu", seed=0):
    """The op's arguments: the router's case (logits of std 8, a bias that changes the winners) and random
    stacks of experts + 1 (the shared expert last)."""
    x, gate, bias = router_case(experts, dim, tokens, torch.bfloat16, seed=seed, device=device)
    stacks = op_args(tokens, topk + 1, experts + 1, dim, inter, 10.0, quantize_x, True, True, False, device=device,
                     seed=seed)[3:6]
    return (x, gate, bias, topk, True, SCALE, *stacks, 10.0, quantize_x, True, experts, out_bf16)


def interpreter_checks():
    """Entry point of the subprocess: each case's launches against the two ops' kernels (one program a column
    block of the shared expert: the same bits) and against the reference (the default split of D)."""
    from dsflash_compile.custom_ops.routed_experts_triton import routed_experts_triton
    from dsflash_compile.custom_ops.routed_moe_triton import routed_moe_triton
    from dsflash_compile.custom_ops.router_triton import fused_router_triton

    for name, case in CASES.items():
        args = case_args(*case)
        x, gate, bias, topk, normalize, scale, *experts = args
        y, weights, ids = routed_moe_triton(*args, shared_splits=1)
        want_weights, want_ids = fused_router_triton(x, gate, bias, topk, normalize, scale)
        want = routed_experts_triton(x, want_weights, want_ids, *experts)
        split = routed_moe_triton(*args)
        ref = torch.ops.dsflash.routed_moe(*args)  # CPU: the reference
        report(dict(name=name, same=torch.equal(y, want) and torch.equal(weights, want_weights)
                    and torch.equal(ids, want_ids), same_ids_as_reference=torch.equal(split[2], ref[2]),
                    err=((split[0].float() - ref[0].float()).abs().max() / ref[0].float().abs().max()).item()))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_routed_moe", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_launches_match_the_two_ops_kernels_and_the_reference(interpreted, name):
    result = interpreted[name]
    assert result["same"] and result["same_ids_as_reference"], result
    assert result["err"] <= 2e-2, result  # the GEMMs' other summation order can move a bf16 or FP8 rounding


def test_reference_is_the_two_ops_and_opcheck():
    """On CPU the op is fused_router's then routed_experts' references; opcheck; routed_experts' input errors."""
    args = case_args(*CASES["three_tokens_fp32_sum"])
    x, gate, bias, topk, normalize, scale, *experts = args
    y, weights, ids = torch.ops.dsflash.routed_moe(*args)
    want_weights, want_ids = torch.ops.dsflash.fused_router(x, gate, bias, topk, normalize, scale)
    assert torch.equal(weights, want_weights) and torch.equal(ids, want_ids)
    assert torch.equal(y, torch.ops.dsflash.routed_experts(x, weights, ids, *experts))
    torch.library.opcheck(torch.ops.dsflash.routed_moe.default, args)
    with pytest.raises(ValueError, match="shared_expert=9 is not a slice of the 9 stacked"):
        torch.ops.dsflash.routed_moe(*args[:12], 9, False)


_ARGS = dict(x_ptr="*bf16", gate_ptr="*bf16", bias_ptr="*fp32", partial_ptr="*fp32", scores_ptr="*fp32",
             counter_ptr="*i32", weights_ptr="*fp32", ids_ptr="*i64", N="i32", D="i32", E="i32",
             k_blocks_per_split="i32", scale="fp32", token_blocks="i32", expert_blocks="i32", splits="i32",
             w1_ptr="*bf16", w3_ptr="*bf16", h_ptr="*bf16", sums_ptr="*fp32", KK="i32", SLOTS="i32", shared="i32", I="i32",
             limit="fp32")


@pytest.mark.parametrize("experts_pad", [8, 512])
def test_first_launch_compiles_for_hopper_without_spills(experts_pad):
    """The router + shared expert launch at its one token tile (MAX_TOKENS rows) with the up kernel's launch, top-6,
    the release's FP8 of x and h, for flash-40l-e8's gate (8 experts) and the release's (384, padded to 512)."""
    from dsflash_compile.custom_ops import routed_experts_triton, routed_moe_triton

    block_m = routed_moe_triton.MAX_TOKENS
    up, _ = routed_experts_triton.launches(block_m)
    constexprs = dict(TOPK=6, K_PAD=8, E_PAD=experts_pad, SPLITS_PAD=16, BLOCK_T=16,
                      BLOCK_E=16, ROUTER_BLOCK_K=128, NORMALIZE=True, X_FP32=False, QUANT_X=True, QUANT_H=True,
                      BLOCK_M=block_m, BLOCK_N=up["block_n"], BLOCK_K=up["block_k"], SHARED_SPLITS=4,
                      FP32_DOT=False)
    check_compiles_for_hopper(routed_moe_triton, ("_router_shared_up_kernel", _ARGS, constexprs, up["num_warps"]))


# ----------------------------------------------------------------------------------------------- CUDA


@requires_cuda
@pytest.mark.parametrize("tokens", [1, 4, 16, 17, 64])
def test_release_sizes_on_cuda(tokens):
    """D = 5120, I = 2304, 8 routed experts + the shared one, top-6 (flash-40l-e8): one program a column block of
    the shared expert gives the two ops' bits; the default split of D the same routing, values within the GEMMs'
    summation order (above MAX_TOKENS the op runs the two ops: their bits); replayed in a CUDA graph on a new x;
    opcheck."""
    from dsflash_compile.custom_ops.routed_moe_triton import MAX_TOKENS, routed_moe_triton

    args = case_args(tokens, 8, 5120, 2304, 6, True, True, device="cuda")
    x, gate, bias, topk, normalize, scale, *experts = args
    weights, ids = torch.ops.dsflash.fused_router(x, gate, bias, topk, normalize, scale)
    want = torch.ops.dsflash.routed_experts(x, weights, ids, *experts)
    got = torch.ops.dsflash.routed_moe(*args)
    assert torch.equal(got[1], weights) and torch.equal(got[2], ids)
    if tokens > MAX_TOKENS:
        assert torch.equal(got[0], want)
    else:
        one = routed_moe_triton(*args, shared_splits=1)
        assert torch.equal(one[0], want) and torch.equal(one[1], weights) and torch.equal(one[2], ids)
        assert ((got[0].float() - want.float()).abs().max() / want.float().abs().max()).item() <= 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dsflash.routed_moe(*args)
    x.copy_(case_args(tokens, 8, 5120, 2304, 6, True, True, device="cuda", seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, torch.ops.dsflash.routed_moe(*args)))
    torch.library.opcheck(torch.ops.dsflash.routed_moe.default, args)
