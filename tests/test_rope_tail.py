"""`dsflash::rope_` (custom_ops/rope_tail.py): RoPE of the query heads' trailing pairs in place.

The Triton kernel under the interpreter and on a GPU against the reference (rope.apply_rope's values; on the GPU
within one bf16 ulp: its FMAs round once where torch rounds twice); only the rotated dims are written; compiled for
sm_90 without spills; opcheck and errors; compiled after a projection, the graph rotates the projection's output
in place (no copy of q); and the model with it (compile()'s q_rope_op) gives the same logits."""

import re

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_compile import compiled_with_op_counted, fresh_dynamo  # noqa: F401  (fresh_dynamo: a fixture)
from test_mhc_fusion import bf16_ulps
from torch._inductor.utils import run_and_get_code

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.custom_ops.rope_tail import rope_reference_
from dsflash_compile.rope import apply_rope, inverse_frequencies, rotation

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (leading dims, heads (None: no heads dim), D, rope pairs)
CASES = {
    "decode_release": ((1, 1), 64, 512, 32),
    "decode_b64": ((64, 1), 64, 512, 32),
    "chunk": ((2, 3), 16, 128, 8),
    "odd_heads": ((1, 2), 5, 64, 16),  # a part-empty head block
    "no_heads_dim": ((2, 4), None, 64, 32),  # every dim rotated
}


def case_inputs(lead, heads, dim, pairs, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, *((heads,) if heads else ()), dim, generator=g).bfloat16()
    rot = rotation(torch.randint(0, 1 << 20, lead, generator=g), inverse_frequencies(2 * pairs, 10000.0))
    return x.to(device), rot.to(device)


def compare(run, device="cpu") -> dict:
    """{case: (ulps against apply_rope, the unrotated dims untouched)}."""
    results = {}
    for name, case in CASES.items():
        x, rot = case_inputs(*case, device=device)
        got = x.clone()
        run(got, rot)
        kept = x.shape[-1] - 2 * rot.shape[-2]
        results[name] = (bf16_ulps(got, apply_rope(x, rot)), torch.equal(got[..., :kept], x[..., :kept]))
    return results


def interpreter_checks():
    """Entry point of the subprocess."""
    from dsflash_compile.custom_ops.rope_tail_triton import rope_tail_triton_

    for name, (ulps, kept) in compare(rope_tail_triton_).items():
        report(dict(name=name, ulps=ulps, kept=kept))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_rope_tail", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    result = interpreted[name]
    assert result["ulps"] == 0 and result["kept"], result  # no FMA under the interpreter: torch's bits


def test_opcheck_and_errors():
    x, rot = case_inputs(*CASES["chunk"])
    torch.library.opcheck(torch.ops.dsflash.rope_.default, (x, rot))
    with pytest.raises(TypeError, match="x must be bf16 and rot fp32"):
        torch.ops.dsflash.rope_(x.float(), rot)
    with pytest.raises(ValueError, match="rot has shape"):
        torch.ops.dsflash.rope_(x, rot[:1])
    with pytest.raises(ValueError, match="2 \\* pairs <= 8"):
        torch.ops.dsflash.rope_(x[..., :8], rot)
    with pytest.raises(ValueError, match="1 <= pairs"):
        torch.ops.dsflash.rope_(x, rot[..., :0, :])


def test_kernel_compiles_for_hopper_without_spills():
    from dsflash_compile.custom_ops import rope_tail_triton as module

    args = dict(x_ptr="*bf16", rot_ptr="*fp32", H="i32", D="i32")
    check_compiles_for_hopper(module, ("_rope_tail_kernel", args, dict(HEADS=16, PAIRS=32), 4),
                              ("x_ptr", "rot_ptr", "D"))


@torch.no_grad()
def test_compiled_after_a_projection_it_rotates_that_buffer_in_place():
    proj = torch.nn.Linear(32, 4 * 64, bias=False).bfloat16()
    rot = rotation(torch.arange(3).view(1, 3), inverse_frequencies(16, 10000.0))

    def step(x):
        q = proj(x).unflatten(-1, (4, 64))
        torch.ops.dsflash.rope_(q, rot)
        return q

    x = torch.randn(1, 3, 32).bfloat16()
    out, (code, *_) = run_and_get_code(torch.compile(step), x)
    assert torch.equal(out, apply_rope(proj(x).unflatten(-1, (4, 64)), rot))
    # one q-sized bf16 buffer (the projection's output, rotated by the op), no clone of it
    assert len(re.findall(r"empty_strided\w*\(\((?:1, )?(?:3, )?(?:4, 64|256)\)[^\n]*bfloat16", code)) == 1, code
    assert "clone" not in code and "copy_" not in code, code


@torch.no_grad()
def test_the_model_takes_the_op_where_compile_says(fresh_dynamo):
    model, want, got, calls = compiled_with_op_counted("rope_", rope_reference_)
    assert all(layer.attn.rope_op for layer in model.model.layers)
    assert calls and torch.equal(got, want)
    dsflash_compile.compile(model, max_batch=2, max_length=32, backend="eager", q_rope_op=False)
    assert not any(layer.attn.rope_op for layer in model.model.layers)


@requires_cuda
def test_kernel_on_cuda_and_in_a_cuda_graph():
    for name, (ulps, kept) in compare(torch.ops.dsflash.rope_, device="cuda").items():
        assert ulps <= 1 and kept, (name, ulps)
    x, rot = case_inputs(*CASES["decode_b64"], device="cuda")  # against Inductor's kernel (its FMAs too)
    inductor, op = torch.compile(apply_rope)(x, rot), x.clone()
    torch.ops.dsflash.rope_(op, rot)
    print("decode_b64 against Inductor: ulps", bf16_ulps(op, inductor), "differing",
          (op != inductor).sum().item(), "of", op[..., -64:].numel())
    assert bf16_ulps(op, inductor) <= 1
    x, rot = case_inputs(*CASES["decode_release"], device="cuda")
    torch.ops.dsflash.rope_(x.clone(), rot)  # compiles the kernel outside the capture
    graph, buffer = torch.cuda.CUDAGraph(), x.clone()
    with torch.cuda.graph(graph):
        torch.ops.dsflash.rope_(buffer, rot)
    fresh, fresh_rot = case_inputs(*CASES["decode_release"], seed=1, device="cuda")
    buffer.copy_(fresh)
    rot.copy_(fresh_rot)
    graph.replay()
    want = fresh.clone()
    torch.ops.dsflash.rope_(want, fresh_rot)
    assert torch.equal(buffer, want)
