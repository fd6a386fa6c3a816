"""`dsflash::fp8_qdq` (custom_ops/fp8_qdq.py): the activations' FP8 quantize-dequantize at a fixed launch.

The Triton kernel under the interpreter and on a GPU gives quant.fp8_qdq's bits (and, on a GPU, Inductor's
compiled fp8_qdq's); compiled for sm_90 without spills; opcheck and errors; the model takes the op where
compile() says, with the same logits."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_compile import compiled_with_op_counted, fresh_dynamo  # noqa: F401  (fresh_dynamo: a fixture)

import dsflash_compile
from dsflash_compile.layers import QuantLinear
from dsflash_compile.quant import fp8_qdq

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: input shape (the kernel's programs hold 32 groups: "tail" leaves its last program part empty)
CASES = {"decode_row": (1, 1, 5120), "decode_b64": (64, 1, 5120), "tail": (3, 7, 96), "one_group": (1, 32)}


def case_input(shape, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-6, 3, shape[-1])  # groups from tiny to large
    x.view(-1, shape[-1])[0, :32] = 0  # an all-zero group (the amax floor)
    x.view(-1, shape[-1])[-1, -32:] = 1e-30  # a group below it
    return x.bfloat16().to(device)


def compare(run, device="cpu") -> dict:
    """{case: values that differ from quant.fp8_qdq's}."""
    return {name: (run(x := case_input(shape, device=device)) != fp8_qdq(x)).sum().item()
            for name, shape in CASES.items()}


def interpreter_checks():
    """Entry point of the subprocess."""
    from dsflash_compile.custom_ops.fp8_qdq_triton import fp8_qdq_triton

    for name, differing in compare(fp8_qdq_triton).items():
        report(dict(name=name, differing=differing))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_fp8_qdq", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    assert interpreted[name]["differing"] == 0, interpreted[name]


def test_opcheck_and_errors():
    x = case_input(CASES["tail"])
    torch.library.opcheck(torch.ops.dsflash.fp8_qdq.default, (x,))
    assert torch.equal(torch.ops.dsflash.fp8_qdq(x), fp8_qdq(x))
    with pytest.raises(TypeError, match="x must be bf16"):
        torch.ops.dsflash.fp8_qdq(x.float())
    with pytest.raises(ValueError, match="multiple of the FP8 group"):
        torch.ops.dsflash.fp8_qdq(x[..., :40])


def test_kernel_compiles_for_hopper_without_spills():
    from dsflash_compile.custom_ops import fp8_qdq_triton as module

    args = dict(x_ptr="*bf16", out_ptr="*bf16", n_groups="i32")
    check_compiles_for_hopper(module, ("_fp8_qdq_kernel", args, dict(GROUPS=module.GROUPS), 4),
                              ("x_ptr", "out_ptr"))


@torch.no_grad()
def test_the_model_takes_the_op_where_compile_says(fresh_dynamo):
    model, want, got, calls = compiled_with_op_counted("fp8_qdq", fp8_qdq)
    linears = [m for m in model.modules() if type(m) is QuantLinear and m.quantize_input]
    assert linears and all(m.qdq_op_rows == 64 for m in linears)
    assert calls and torch.equal(got, want)
    dsflash_compile.compile(model, max_batch=2, max_length=32, backend="eager", qdq_op_rows=0)
    assert not any(m.qdq_op_rows for m in linears)


@requires_cuda
def test_kernel_on_cuda_matches_the_reference_and_inductor():
    assert all(d == 0 for d in compare(torch.ops.dsflash.fp8_qdq, device="cuda").values())
    x = case_input(CASES["decode_b64"], device="cuda")
    assert torch.equal(torch.ops.dsflash.fp8_qdq(x), torch.compile(fp8_qdq)(x))
