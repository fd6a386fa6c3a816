"""`dsflash::rope_fp4_qdq_` (custom_ops/rope_fp4_qdq.py): the indexer query's RoPE and FP4 QDQ in place.

The Triton kernel under the interpreter gives the reference's bits (apply_rope then quant.fp4_qdq_ue8m0), on a GPU
those of dsflash::rope_ (the same FMAs) then the QDQ; compiled for sm_90 without spills; opcheck and errors; the
model takes the op where compile() says, with the same logits, and the skipped key/latent QDQs change no record."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_compile import compiled_with_op_counted, fresh_dynamo  # noqa: F401  (fresh_dynamo: a fixture)

import dsflash_compile
from dsflash_compile.custom_ops.records import decode_reference, encode_reference
from dsflash_compile.custom_ops.rope_fp4_qdq import rope_fp4_qdq_reference_
from dsflash_compile.quant import fp4_qdq_e4m3, fp4_qdq_ue8m0
from dsflash_compile.rope import apply_rope, inverse_frequencies, rotation

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (leading dims, heads (None: no heads dim), D, rope pairs)
CASES = {
    "index_query": ((1, 1), 32, 128, 32),  # the release's indexer query at decode
    "index_query_b64": ((64, 1), 32, 128, 32),
    "chunk": ((2, 3), 16, 128, 8),
    "odd_heads": ((1, 2), 5, 64, 16),  # a part-empty head block
    "d96": ((1, 2), 3, 96, 16),  # D below its power of two: masked columns
    "no_heads_dim": ((2, 4), None, 128, 32),
}


def case_inputs(lead, heads, dim, pairs, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, *((heads,) if heads else ()), dim, generator=g) * torch.logspace(-4, 4, dim)
    rows = x.view(-1, dim)
    rows[0, :32] = 0  # an all-zero group (the amax floor)
    rows[0, 32:64] = -0.0  # negative zeros (kept)
    rows[-1, :32] = 1e-38  # a group below the floor
    rot = rotation(torch.randint(0, 1 << 20, lead, generator=g), inverse_frequencies(2 * pairs, 10000.0))
    return x.bfloat16().to(device), rot.to(device)


def bits(x):
    return x.view(torch.int16)


def compare(run, device="cpu", rope=None) -> dict:
    """{case: values whose bits differ from the reference's} (rope: the RoPE before the QDQ; default apply_rope)."""
    results = {}
    for name, case in CASES.items():
        x, rot = case_inputs(*case, device=device)
        got = x.clone()
        run(got, rot)
        if rope is None:
            want = fp4_qdq_ue8m0(apply_rope(x, rot))
        else:
            want = x.clone()
            rope(want, rot)
            want = fp4_qdq_ue8m0(want)
        results[name] = (bits(got) != bits(want)).sum().item()
    return results


def interpreter_checks():
    """Entry point of the subprocess."""
    from dsflash_compile.custom_ops.rope_fp4_qdq_triton import rope_fp4_qdq_triton_

    for name, differing in compare(rope_fp4_qdq_triton_).items():
        report(dict(name=name, differing=differing))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_rope_fp4_qdq", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    assert interpreted[name]["differing"] == 0, interpreted[name]  # no FMA under the interpreter: torch's bits


def test_opcheck_and_errors():
    x, rot = case_inputs(*CASES["chunk"])
    torch.library.opcheck(torch.ops.dsflash.rope_fp4_qdq_.default, (x, rot))
    got = x.clone()
    torch.ops.dsflash.rope_fp4_qdq_(got, rot)
    assert torch.equal(bits(got), bits(fp4_qdq_ue8m0(apply_rope(x, rot))))
    with pytest.raises(TypeError, match="x must be bf16 and rot fp32"):
        torch.ops.dsflash.rope_fp4_qdq_(x.float(), rot)
    with pytest.raises(ValueError, match="rot has shape"):
        torch.ops.dsflash.rope_fp4_qdq_(x, rot[:1])
    with pytest.raises(ValueError, match="multiple of the FP4 group"):
        torch.ops.dsflash.rope_fp4_qdq_(x[..., :48], rot)


def test_kernel_compiles_for_hopper_without_spills():
    from dsflash_compile.custom_ops import rope_fp4_qdq_triton as module

    args = dict(x_ptr="*bf16", rot_ptr="*fp32", H="i32", D="i32")
    check_compiles_for_hopper(module, ("_rope_fp4_qdq_kernel", args, dict(HEADS=8, DP=128, PAIRS=32), 4),
                              ("x_ptr", "rot_ptr", "D"))


def test_records_encode_the_skipped_qdqs():
    """compile() or not, index keys and compressed rows go to records without their QDQ where the record's
    encoding is that QDQ: the stored values are the same."""
    x, _ = case_inputs(*CASES["no_heads_dim"])
    for fmt, qdq in (("mxfp4", fp4_qdq_ue8m0), ("nvfp4", fp4_qdq_e4m3)):
        once = decode_reference(encode_reference(x, fmt), fmt, x.shape[-1])
        twice = decode_reference(encode_reference(qdq(x), fmt), fmt, x.shape[-1])
        assert torch.equal(bits(once), bits(twice)) and torch.equal(bits(once), bits(qdq(x))), fmt


@torch.no_grad()
def test_the_model_takes_the_op_where_compile_says(fresh_dynamo):
    model, want, got, calls = compiled_with_op_counted("rope_fp4_qdq_", rope_fp4_qdq_reference_)
    indexers = [layer.attn.indexer for layer in model.model.layers if layer.attn.indexer is not None]
    assert indexers and all(indexer.rope_op for indexer in indexers)
    assert len(calls) >= len(indexers) and torch.equal(got, want)
    dsflash_compile.compile(model, max_batch=2, max_length=32, backend="eager", index_rope_op=False)
    assert not any(indexer.rope_op for indexer in indexers)


@requires_cuda
def test_kernel_on_cuda_matches_the_rope_op_then_the_qdq():
    assert all(d == 0 for d in compare(torch.ops.dsflash.rope_fp4_qdq_, "cuda", torch.ops.dsflash.rope_).values())
    x, rot = case_inputs(*CASES["index_query_b64"], device="cuda")  # against Inductor's kernel (its FMAs too)
    op = x.clone()
    torch.ops.dsflash.rope_fp4_qdq_(op, rot)
    inductor = torch.compile(lambda x, rot: fp4_qdq_ue8m0(apply_rope(x, rot)))(x, rot)
    print("index_query_b64 against Inductor: differing", (bits(op) != bits(inductor)).sum().item(), "of", op.numel())
