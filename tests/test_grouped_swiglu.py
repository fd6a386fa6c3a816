"""`dsflash::grouped_swiglu` (custom_ops/grouped_swiglu.py): its reference against MoE's unfused sorted path, its
Triton kernel under the interpreter (bit for bit on data whose GEMMs are exact in fp32; within the GEMMs'
summation order on random data) and on CUDA, compiled for sm_90 without spills, opcheck, its errors, and MoE
taking it where it applies."""

import pytest
import torch
import torch.nn.functional as F
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_moe_small import case_inputs

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.custom_ops.expert_order import expert_order_reference
from dsflash_compile.custom_ops.grouped_swiglu import grouped_swiglu_reference
from dsflash_compile.custom_ops.grouped_swiglu_triton import LAUNCHES
from dsflash_compile.quant import fp8_qdq

# name: (tokens, slots, experts, D, I, limit, quantize_h, exact data); the last slot is the shared expert
CASES = {
    "one_token": (1, 7, 9, 64, 64, 10.0, True, True),  # 16-row tiles
    "elsewhere_pairs": (3, 4, 5, 96, 96, 0.5, True, True),  # pairs -1 sort past the last offset: h rows zero
    "no_clamp_no_fp8": (5, 3, 6, 64, 32, 0.0, False, True),
    "ragged_blocks": (17, 4, 9, 96, 160, 10.0, True, True),  # D, I not multiples of the blocks
    "tall_tiles": (64, 7, 9, 64, 64, 10.0, True, True),  # 64-row tiles (decode batch 64)
    "random_data": (6, 7, 9, 256, 128, 10.0, True, False),
}


# label: launch overrides. 64-row, 32-column tiles (the default's 64 columns hold two FP8 groups a block; 32 one)
LAUNCH_VARIANTS = {"": {}, "_narrow": dict(block_m=64, block_n=32, num_warps=4)}
VARIANT_CASES = ("elsewhere_pairs", "ragged_blocks", "random_data")  # the interpreter is slow at 64 tokens


def op_args(tokens, slots, experts, dim, inter, limit, quantize_h, exact, seed=0):
    """The op's arguments as MoE passes them: x FP8-rounded, the pairs sorted by expert (ids -1 last)."""
    x, weights, ids, w1, w3, _ = case_inputs(tokens, slots, experts, dim, inter, exact, seed=seed)
    order, _, offsets, _ = expert_order_reference(ids, experts)
    return fp8_qdq(x), weights, order, w1, w3, offsets, limit, quantize_h


def per_pair(x, weights, order, w1, w3, offsets, limit, quantize_h):
    """Each sorted row on its own, as moe.Expert computes a token: its pair's token row through its expert (the
    expert whose offsets range holds the row), times the pair's weight; rows past the last offset zero."""
    k = weights.shape[1]
    h = torch.zeros(order.shape[0], w1.shape[1], dtype=x.dtype)
    for r in range(int(offsets[-1])):
        e = int(torch.searchsorted(offsets, r, right=True))
        t, s = divmod(int(order[r]), k)
        gate, up = F.linear(x[t], w1[e]).float(), F.linear(x[t], w3[e]).float()
        if limit > 0:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        h[r] = (weights[t, s] * (F.silu(gate) * up)).to(x.dtype)
    return fp8_qdq(h) if quantize_h else h


@pytest.mark.parametrize("name", list(CASES))
def test_reference_is_each_pair_through_its_expert(name):
    args = op_args(*CASES[name])
    got, want = grouped_swiglu_reference(*args), per_pair(*args)
    if CASES[name][-1]:
        assert torch.equal(got, want)
    else:  # one row's GEMM against a batch's: another summation order can move a bf16, then an FP8 rounding
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= 2e-2
    pairs_here = int(args[5][-1])
    assert not got[pairs_here:].any()  # the pairs no expert here takes


def test_opcheck():
    torch.library.opcheck(torch.ops.dsflash.grouped_swiglu.default, op_args(*CASES["elsewhere_pairs"]))


def test_bad_inputs_are_named():
    x, weights, order, w1, w3, offsets, limit, quantize_h = op_args(*CASES["one_token"])
    with pytest.raises(ValueError, match="order must be int64"):
        torch.ops.dsflash.grouped_swiglu(x, weights, order.int(), w1, w3, offsets, limit, quantize_h)
    with pytest.raises(ValueError, match="offsets must be int32"):
        torch.ops.dsflash.grouped_swiglu(x, weights, order, w1, w3, offsets[:-1], limit, quantize_h)
    with pytest.raises(TypeError, match="weights fp32"):
        torch.ops.dsflash.grouped_swiglu(x, weights.bfloat16(), order, w1, w3, offsets, limit, quantize_h)
    with pytest.raises(ValueError, match="differ in D"):
        torch.ops.dsflash.grouped_swiglu(x[:, :32], weights, order, w1, w3, offsets, limit, quantize_h)
    with pytest.raises(ValueError, match="multiple of the FP8 group"):
        torch.ops.dsflash.grouped_swiglu(x, weights, order, w1[:, :48], w3[:, :48], offsets, limit, True)


def interpreter_checks():
    """Entry point of the subprocess: every case's kernel against the reference at the default launch, and
    VARIANT_CASES at LAUNCH_VARIANTS' others."""
    from dsflash_compile.custom_ops.grouped_swiglu_triton import grouped_swiglu_triton

    for name, case in CASES.items():
        args = op_args(*case)
        want = grouped_swiglu_reference(*args)
        for label, launch in LAUNCH_VARIANTS.items():
            if label and name not in VARIANT_CASES:
                continue
            got = grouped_swiglu_triton(*args, **launch)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            report(dict(name=name + label, same=torch.equal(got, want), err=err))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_grouped_swiglu", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES) + [n + label for n in VARIANT_CASES for label in LAUNCH_VARIANTS if label])
def test_kernel_matches_reference(interpreted, name):
    result = interpreted[name]
    if CASES[name.removesuffix("_narrow")][-1]:
        assert result["same"], result
    else:  # a GEMM's other summation order can move a bf16 rounding, and an FP8 one after it
        assert result["err"] <= 2e-2, result


@pytest.mark.parametrize("launch", [s for _, s in LAUNCHES] + [(32, 32, 64, 4, 3), (64, 32, 64, 4, 4)])  # + swept
def test_kernel_compiles_for_hopper(launch):
    from dsflash_compile.custom_ops import grouped_swiglu_triton

    block_m, block_n, block_k, warps, _ = launch
    args = dict(x_ptr="*bf16", weights_ptr="*fp32", order_ptr="*i64", w1_ptr="*bf16", w3_ptr="*bf16",
                offsets_ptr="*i32", h_ptr="*bf16", P="i32", E="i32", I="i32", D="i32", KK="i32", limit="fp32")
    constexprs = dict(QUANT_H=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, E_PAD=16, FP32_DOT=False)
    check_compiles_for_hopper(grouped_swiglu_triton, ("_grouped_swiglu_kernel", args, constexprs, warps),
                              ("x_ptr", "weights_ptr", "order_ptr", "w1_ptr", "w3_ptr", "offsets_ptr", "h_ptr",
                               "D", "I"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 17, 64])
def test_release_sizes_on_cuda(tokens):
    """flash-40l-e8's MoE (8 routed + the shared slice, D 5120, I 2304) on random data, against the reference."""
    args = op_args(tokens, 7, 9, 5120, 2304, 10.0, True, False, seed=tokens)
    want = grouped_swiglu_reference(*args)
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    got = torch.ops.dsflash.grouped_swiglu(*cuda_args).cpu()
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= 2e-2


@torch.no_grad()
@pytest.mark.parametrize("shared", [False, True])
def test_moe_takes_the_op_where_it_applies(shared, monkeypatch):
    """With swiglu_op (compile() sets it) the sorted path runs the op up to few_rows pairs and gives the expert
    loop's bits (CPU: the reference), also compiled; above few_rows the unfused path runs."""
    from test_native_weights import tiny_moe

    moe = tiny_moe()
    x = torch.randn(4, 1, moe.gate.weight.shape[1]).bfloat16()
    want = moe(x)
    moe.stack_experts(shared=shared and moe.can_stack_shared())
    moe.few_rows, moe.count_order, moe.swiglu_op = 64, 1 << 22, True
    calls = []
    real = torch.ops.dsflash.grouped_swiglu

    def counted(*args):
        calls.append(args[2].shape[0])
        return real(*args)
    monkeypatch.setattr(torch.ops.dsflash, "grouped_swiglu", counted)
    assert torch.equal(moe(x), want) and calls
    moe.few_rows, calls[:] = 1, []
    assert torch.equal(moe(x), want) and not calls
    monkeypatch.undo()  # Dynamo traces the op itself, not a Python wrapper
    moe.few_rows = 64
    assert torch.equal(torch.compile(moe, backend="aot_eager", fullgraph=True)(x), want)
