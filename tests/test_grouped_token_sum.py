"""`dsflash::grouped_token_sum` (custom_ops/grouped_token_sum.py): its reference against MoE's unfused sorted path,
its Triton kernel under the interpreter (bit for bit on data whose GEMMs are exact in fp32; within the GEMMs'
summation order on random data) and on CUDA (also inside a CUDA graph, where the counters must come back to
zero), compiled for sm_90 without spills, opcheck, its errors, and MoE taking it where it applies."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_expert_order import routed_ids
from test_grouped_swiglu import check_moe_takes_op

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.custom_ops.expert_order import expert_order_reference
from dsflash_compile.custom_ops.grouped_token_sum import grouped_token_sum_reference
from dsflash_compile.custom_ops.mxfp4_experts import grouped_mm_reference

# name: (tokens, slots, experts, K, N, share of pairs elsewhere (-1), exact data)
CASES = {
    "one_token": (1, 7, 9, 64, 64, 0.0, True),  # 16-row tiles
    "elsewhere_pairs": (3, 4, 5, 96, 96, 0.3, True),  # pairs -1 sort past the last offset: they add nothing
    "one_slot": (5, 1, 6, 64, 32, 0.0, True),
    "ragged_blocks": (17, 4, 9, 96, 160, 0.0, True),  # N not a multiple of the column block
    "tall_tiles": (64, 7, 9, 64, 64, 0.0, True),  # 64-row tiles (decode batch 64), two steps of the token sum
    "random_data": (6, 7, 9, 256, 128, 0.1, False),
}


def op_args(tokens, slots, experts, k_dim, n, elsewhere, exact, seed=0):
    """The op's arguments as MoE passes them: h sorted by expert (rows past the last offset: what the first
    half leaves there), the stacked w2, offsets, rank and each token's ascending slots. Exact data: values on a
    coarse grid, so that every GEMM sum and the token sums are exact in fp32."""
    g = torch.Generator().manual_seed(seed)

    def values(*shape, div):
        if exact:
            return (torch.randint(-3, 4, shape, generator=g) / div).bfloat16()
        return (torch.randn(shape, generator=g) / div).bfloat16()

    ids = routed_ids(tokens, slots, experts, elsewhere, seed=seed)
    _, rank, offsets, ascending = expert_order_reference(ids, experts)
    return values(tokens * slots, k_dim, div=2), values(experts, n, k_dim, div=16), offsets, rank, ascending


@pytest.mark.parametrize("name", list(CASES))
def test_reference_sums_each_tokens_pairs_in_ascending_id(name):
    """From the routing itself: each token's pair rows (where rank put them) added in ascending expert id, from
    zero; pairs elsewhere (-1) add nothing."""
    tokens, slots, experts, _, _, elsewhere, _ = CASES[name]
    x, weight, offsets, rank, ascending = op_args(*CASES[name])
    ids = routed_ids(tokens, slots, experts, elsewhere)
    out = grouped_mm_reference(x, weight, offsets)
    want = torch.zeros(tokens, weight.shape[1])
    for t in range(tokens):
        for s in sorted(range(slots), key=lambda s: ids[t, s].item()):
            if ids[t, s] >= 0:
                want[t] += out[rank[t * slots + s]].float()
    assert torch.equal(grouped_token_sum_reference(x, weight, offsets, rank, ascending), want)


def test_opcheck():
    torch.library.opcheck(torch.ops.dsflash.grouped_token_sum.default, op_args(*CASES["elsewhere_pairs"]))


def test_bad_inputs_are_named():
    x, weight, offsets, rank, ascending = op_args(*CASES["one_token"])
    with pytest.raises(ValueError, match="ascending must be int64"):
        torch.ops.dsflash.grouped_token_sum(x, weight, offsets, rank, ascending[:, :3])
    with pytest.raises(ValueError, match="rank must be int64"):
        torch.ops.dsflash.grouped_token_sum(x, weight, offsets, rank.int(), ascending)
    with pytest.raises(ValueError, match="offsets must be int32"):
        torch.ops.dsflash.grouped_token_sum(x, weight, offsets[:-1], rank, ascending)
    with pytest.raises(ValueError, match="differ in K"):
        torch.ops.dsflash.grouped_token_sum(x[:, :32], weight, offsets, rank, ascending)


def interpreter_checks():
    """Entry point of the subprocess: every case's kernel against the reference, at the default launch and at
    64-row tiles with 32-column blocks."""
    from dsflash_compile.custom_ops.grouped_token_sum_triton import grouped_token_sum_triton

    for name, case in CASES.items():
        args = op_args(*case)
        want = grouped_token_sum_reference(*args)
        for label, launch in (("", {}), ("_tall", dict(block_m=64, block_n=32, block_k=64))):
            got = grouped_token_sum_triton(*args, **launch)
            err = ((got - want).abs().max() / want.abs().max()).item()
            report(dict(name=name + label, same=torch.equal(got, want), err=err))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_grouped_token_sum", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", [n + label for n in CASES for label in ("", "_tall")])
def test_kernel_matches_reference(interpreted, name):
    result = interpreted[name]
    if CASES[name.removesuffix("_tall")][-1]:
        assert result["same"], result
    else:  # a GEMM's other summation order can move the bf16 rounding of a pair's row
        assert result["err"] <= 2 ** -7, result


@pytest.mark.parametrize("block_m, block_n, block_k, warps, stages",
                         [(16, 32, 128, 4, 3), (32, 128, 128, 4, 3), (64, 64, 64, 4, 4)])  # bf16_launch's
def test_kernel_compiles_for_hopper(block_m, block_n, block_k, warps, stages):
    from dsflash_compile.custom_ops import grouped_token_sum_triton

    args = dict(x_ptr="*bf16", w_ptr="*bf16", offsets_ptr="*i32", out_ptr="*bf16", rank_ptr="*i64",
                ascending_ptr="*i64", y_ptr="*fp32", counter_ptr="*i32", P="i32", E="i32", N="i32", K="i32",
                T="i32", KK="i32")
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, E_PAD=16,
                      BLOCK_T=grouped_token_sum_triton.block_t(block_n), KK_PAD=8, FP32_DOT=False)
    check_compiles_for_hopper(grouped_token_sum_triton, ("_grouped_token_sum_kernel", args, constexprs, warps),
                              ("x_ptr", "w_ptr", "offsets_ptr", "out_ptr", "rank_ptr", "ascending_ptr", "y_ptr", "N",
                               "K"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 17, 64])
def test_release_sizes_on_cuda(tokens):
    """flash-40l-e8's down projection (8 routed + the shared slice, K 2304, N 5120) on random data, eagerly and
    replayed in a CUDA graph twice (the counters come back to zero), against the reference."""
    args = op_args(tokens, 7, 9, 2304, 5120, 0.0, False, seed=tokens)
    want = grouped_token_sum_reference(*args)
    cuda_args = [a.cuda() for a in args]
    got = torch.ops.dsflash.grouped_token_sum(*cuda_args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = torch.ops.dsflash.grouped_token_sum(*cuda_args)
    for _ in range(2):
        graph.replay()
        assert torch.equal(replayed, got)
    assert ((got.cpu() - want).abs().max() / want.abs().max()).item() <= 2 ** -7


@pytest.mark.parametrize("shared", [False, True])
def test_moe_takes_the_op_where_it_applies(shared, monkeypatch):
    check_moe_takes_op(monkeypatch, shared, "token_sum_op", "grouped_token_sum")
