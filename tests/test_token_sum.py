"""`dsflash::token_sum` (custom_ops/token_sum.py): MoE's expert-sorted rows summed back per token.

The Triton kernel under the interpreter and on a GPU gives the reference's bits (rows past the last offset skipped
even when they hold NaN, -0.0 kept); compiled for sm_90 without spills; opcheck and errors; the model takes the op
where compile() says, with the same logits."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_compile import compiled_with_op_counted, fresh_dynamo  # noqa: F401  (fresh_dynamo: a fixture)

import dsflash_compile
from dsflash_compile.custom_ops.expert_order import expert_order_reference
from dsflash_compile.custom_ops.token_sum import token_sum_reference

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (tokens, slots, experts, D, rows' dtype, result dtype, share of pairs on another rank)
CASES = {
    "decode_b64": (64, 7, 9, 5120, torch.bfloat16, torch.bfloat16, 0.0),
    "fp32_result": (5, 3, 4, 96, torch.bfloat16, torch.float32, 0.0),
    "fp32_rows": (4, 2, 3, 1030, torch.float32, torch.float32, 0.0),  # a part-empty column block
    "elsewhere": (6, 4, 5, 96, torch.bfloat16, torch.bfloat16, 0.4),  # ids -1: their rows hold NaN, add nothing
}


def case_inputs(tokens, k, experts, dim, rows_dtype, dtype, elsewhere, device="cpu"):
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    ids[torch.rand(tokens, k, generator=g) < elsewhere] = -1
    _, rank, offsets, ascending = expert_order_reference(ids, experts)
    out = torch.randn(tokens * k, dim, generator=g).to(rows_dtype)
    out[int(offsets[-1]):] = float("nan")  # never computed (torch._grouped_mm leaves them undefined)
    out[:, :8] = -0.0  # every slot's -0.0: the sum stays -0.0
    return tuple(t.to(device) for t in (out, rank, ascending, offsets)) + (dtype,)


def bits(y):
    return y.view(torch.int16 if y.dtype == torch.bfloat16 else torch.int32)


def compare(run, device="cpu") -> dict:
    """{case: values whose bits differ from the reference's}."""
    results = {}
    for name, case in CASES.items():
        args = case_inputs(*case, device=device)
        results[name] = (bits(run(*args)) != bits(token_sum_reference(*args))).sum().item()
    return results


def interpreter_checks():
    """Entry point of the subprocess."""
    from dsflash_compile.custom_ops.token_sum_triton import token_sum_triton

    for name, differing in compare(token_sum_triton).items():
        report(dict(name=name, differing=differing))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_token_sum", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    assert interpreted[name]["differing"] == 0, interpreted[name]


def test_reference_sums_in_ascending_expert_order_and_skips_uncomputed_rows():
    out, rank, ascending, offsets, dtype = case_inputs(*CASES["elsewhere"])
    y = token_sum_reference(out, rank, ascending, offsets, torch.float32)
    tokens, k = ascending.shape
    for t in range(tokens):
        want = torch.zeros(out.shape[1])
        for j in range(k):
            row = rank[t * k + ascending[t, j]]
            want = want + (out[row].float() if row < offsets[-1] else 0.0)
        assert torch.allclose(y[t], want, rtol=0, atol=0), t
    assert not y.isnan().any()


def test_opcheck_and_errors():
    args = case_inputs(*CASES["fp32_result"])
    torch.library.opcheck(torch.ops.dsflash.token_sum.default, args)
    out, rank, ascending, offsets, dtype = args
    with pytest.raises(TypeError, match="offsets int32"):
        torch.ops.dsflash.token_sum(out, rank, ascending, offsets.long(), dtype)
    with pytest.raises(ValueError, match="at least one slot"):
        torch.ops.dsflash.token_sum(out, rank[:0], ascending[:, :0], offsets, dtype)
    with pytest.raises(ValueError, match="rank has"):
        torch.ops.dsflash.token_sum(out, rank[1:], ascending, offsets, dtype)


def test_kernel_compiles_for_hopper_without_spills():
    from dsflash_compile.custom_ops import token_sum_triton as module

    args = dict(out_ptr="*bf16", rank_ptr="*i64", ascending_ptr="*i64", offsets_ptr="*i32", y_ptr="*bf16", D="i32",
                G="i32")
    constexprs = dict(K=7, KP=8, BLOCK_D=module.BLOCK_D, IN_BF16=True, OUT_BF16=True)
    check_compiles_for_hopper(module, ("_token_sum_kernel", args, constexprs, 4), ("out_ptr", "y_ptr", "D"))


@torch.no_grad()
def test_the_model_takes_the_op_where_compile_says(fresh_dynamo):
    model, want, got, calls = compiled_with_op_counted("token_sum", token_sum_reference)
    moes = [layer.ffn for layer in model.model.layers]
    assert all(moe.token_sum_op for moe in moes)
    assert calls and torch.equal(got, want)
    dsflash_compile.compile(model, max_batch=2, max_length=32, backend="eager", moe_token_sum_op=False)
    assert not any(moe.token_sum_op for moe in moes)


@requires_cuda
def test_kernel_on_cuda_matches_the_reference_and_inductor():
    assert all(d == 0 for d in compare(torch.ops.dsflash.token_sum, device="cuda").values())
    args = case_inputs(*CASES["decode_b64"], device="cuda")
    assert torch.equal(bits(torch.ops.dsflash.token_sum(*args)), bits(torch.compile(token_sum_reference)(*args)))
