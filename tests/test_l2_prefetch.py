"""Weights prefetched into L2 (issue 5): dsflash::l2_prefetch (custom_ops/l2_prefetch.py: changes nothing, its
kernel compiles for sm_90 with the bulk prefetch) and the pass that places it (passes/l2_prefetch.py) after the
first waiting dsflash kernel of a projection's window, counted in compiled graphs whose values do not change; the
GPU tests (skipped here) run the kernel eagerly and in a CUDA graph."""

import operator
import re

import pytest
import torch

import dsflash_compile
from dsflash_compile import quant
from dsflash_compile.custom_ops import l2_prefetch_triton
from dsflash_compile.custom_ops.bf16_linear import bf16_linear_reference
from dsflash_compile.passes import L2PrefetchPass
from dsflash_compile.passes.l2_prefetch import STREAM_MIN_BYTES
from dsflash_compile.rope import inverse_frequencies, rotation
from hopper import compile_for_hopper
from torch._inductor.utils import run_and_get_code
from test_compile import fresh_dynamo, tiny_model  # noqa: F401  (fresh_dynamo: a fixture)
from test_kv_norm_rope import CASES, EPS, case_inputs
from test_mhc_fusion import compiling  # noqa: F401  (a fixture)

ops = torch.ops.dsflash
requires_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                     reason="needs a CUDA device of sm_90 or later")
K, N = 1024, STREAM_MIN_BYTES // (2 * 1024)  # an [N, K] bf16 weight of STREAM_MIN_BYTES


class Recorded:
    """Post-grad pass: L2PrefetchPass, with its count and, per prefetch, (its anchor's op, nbytes, the weight's
    graph input or slice, whether it comes right after its anchor)."""

    def __init__(self, max_bytes=STREAM_MIN_BYTES):
        self.prefetch, self.counts, self.prefetches = L2PrefetchPass(max_bytes), [], []

    def __call__(self, graph):
        self.counts.append(self.prefetch.apply(graph))
        for n in graph.find_nodes(op="call_function", target=ops.l2_prefetch.default):
            after, weight, nbytes, early = n.args
            anchor = after.args[0] if after.target is operator.getitem else after
            self.prefetches.append((str(anchor.target), nbytes, str(weight.target) if weight.op == "call_function"
                                    else weight.op, n.prev is after, early))


@pytest.fixture
def counted():
    """The calls, in order, of the prefetch op (its nbytes), dsflash::fp8_qdq ("qdq") and dsflash::bf16_gemv
    ("gemv") on the CPU (their CPU kernels wrapped)."""
    calls = []
    with torch.library._scoped_library("dsflash", "IMPL") as lib:
        lib.impl("l2_prefetch", lambda after, weight, nbytes, early=True: calls.append(nbytes), "CPU")
        lib.impl("fp8_qdq", lambda x: (calls.append("qdq"), quant.fp8_qdq(x))[-1], "CPU")
        lib.impl("bf16_gemv", lambda *args: (calls.append("gemv"), bf16_linear_reference(*args))[-1], "CPU")
        yield calls


def weights(*shapes):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, generator=g) / shape[-1] ** 0.5).bfloat16() for shape in shapes]


def projections(x, w1, w2, w3):
    """Three projections: the first after a dsflash kernel (its window: the graph's start), the second after
    Inductor's tanh only (no dsflash kernel: no prefetch), the third after a dsflash kernel computed from the
    second."""
    h = ops.bf16_gemv(ops.fp8_qdq(x), w1, 1, False)
    g = ops.bf16_gemv(torch.tanh(h), w2, 1, False)
    return ops.bf16_gemv(ops.fp8_qdq(g * 2), w3, 1, False)


def test_projections_with_a_dsflash_kernel_before_them_get_a_prefetch(compiling, counted):  # noqa: F811
    recorded = Recorded(max_bytes=STREAM_MIN_BYTES // 2)
    args = (torch.randn(1, K).bfloat16(), *weights((N, K), (K, N), (N, K)))
    got = compiling(recorded, projections)(*args)
    want = ("dsflash.fp8_qdq.default", STREAM_MIN_BYTES // 2, "placeholder", True, True)
    assert recorded.counts == [2] and recorded.prefetches == [want, want]
    half = STREAM_MIN_BYTES // 2  # Inductor kept both, right after their anchors
    assert counted == ["qdq", half, "gemv", "gemv", "qdq", half, "gemv"]
    torch.testing.assert_close(got, projections(*args), rtol=0, atol=0)


def test_an_in_place_op_anchors_and_stays_in_place(compiling, counted):  # noqa: F811
    """The window's one dsflash op writes its input in place (dsflash::rope_ on the projection's output, as the
    query's RoPE): functionalized in the pass's graph, it anchors the prefetch, and Inductor still rotates the
    projection's buffer in place (no copy of it)."""
    rot = rotation(torch.arange(1).view(1), inverse_frequencies(16, 10000.0))

    def rotated(x, w1, w2):
        q = ops.bf16_gemv(x, w1, 1, False)
        ops.rope_(q.view(1, N // 64, 64), rot)
        return ops.bf16_gemv(q, w2, 1, False)

    recorded = Recorded()
    args = (torch.randn(1, K).bfloat16(), *weights((N, K), (K, N)))
    got, (code, *_) = run_and_get_code(compiling(recorded, rotated), *args)
    assert recorded.prefetches == [("auto_functionalized_v2", STREAM_MIN_BYTES, "placeholder", True, True)]
    assert counted == ["gemv", STREAM_MIN_BYTES, "gemv"]
    assert "clone" not in code and not re.search(r"\bcopy_\(", code), code
    torch.testing.assert_close(got, rotated(*args), rtol=0, atol=0)


def test_small_weights_and_windows_of_early_kernels_get_none(compiling, counted):  # noqa: F811
    """A weight under STREAM_MIN_BYTES; a window whose only dsflash kernel starts before its wait (it could be
    scheduled before the projection before it has finished)."""
    kv, norm, rot = case_inputs(*CASES["decode_release"])

    def early_window(x, small, w1, w2, kv):
        s = ops.bf16_gemv(ops.fp8_qdq(x), small, 1, False)
        h = ops.bf16_gemv(x, w1, 1, False)  # nothing before it: no window
        row = ops.kv_norm_rope(kv, norm, EPS, rot, True, h, True)
        return ops.bf16_gemv(h * row.reshape(-1)[:1], w2, 1, False), s

    recorded = Recorded()
    args = (torch.randn(1, K).bfloat16(), *weights((64, K), (N, K), (K, N)), kv)
    compiling(recorded, early_window)(*args)
    assert recorded.counts == [0] and all(isinstance(call, str) for call in counted)


def test_the_shared_expert_slice_of_the_routed_experts(compiling, counted):  # noqa: F811
    """dsflash::routed_experts with the shared expert stacked last: its w1 slice is prefetched (the routed
    experts' are known only at run time)."""
    experts, inter = 3, N // 4
    w1, w3, w2 = weights((experts, inter, K), (experts, inter, K), (experts, K, inter))
    ids, routing = torch.tensor([[0, 1]]), torch.tensor([[0.7, 0.3]])

    def moe(x, w1, w3, w2):
        return ops.routed_experts(ops.fp8_qdq(x), routing, ids, w1, w3, w2, 0.0, False, False, experts - 1)

    recorded = Recorded(max_bytes=STREAM_MIN_BYTES)
    args = (torch.randn(1, K).bfloat16(), w1, w3, w2)
    # a quarter of STREAM_MIN_BYTES a slice: too small; four times the intermediate size: prefetched
    compiling(recorded, moe)(*args)
    assert recorded.counts == [0]
    torch._dynamo.reset()
    w1, w3, w2 = weights((experts, 4 * inter, K), (experts, 4 * inter, K), (experts, K, 4 * inter))
    recorded = Recorded(max_bytes=STREAM_MIN_BYTES)
    got = compiling(recorded, moe)(args[0], w1, w3, w2)
    assert recorded.prefetches == [("dsflash.fp8_qdq.default", STREAM_MIN_BYTES, "aten.select.int", False, True)]
    assert counted == ["qdq", "qdq", STREAM_MIN_BYTES]  # the first compile's call, then the second's
    torch.testing.assert_close(got, moe(args[0], w1, w3, w2), rtol=0, atol=0)


def installed(model, **options) -> bool:
    dsflash_compile.compile(model, max_batch=2, max_length=32, backend="eager", **options)
    return "L2PrefetchPass" in [type(p).__name__ for p in torch._inductor.config.post_grad_custom_post_pass.passes]


def test_compile_options_install_it_on_gpus_only(fresh_dynamo):  # noqa: F811
    assert not installed(tiny_model())  # a CPU model: the op would do nothing


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="l2_prefetch_bytes=-1"):
        dsflash_compile.CompileOptions(l2_prefetch_bytes=-1)
    w = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="contiguous"):
        ops.l2_prefetch(torch.zeros(1), w.t(), 16)
    with pytest.raises(ValueError, match="nbytes=200"):
        ops.l2_prefetch(torch.zeros(1), w, 200)


def test_kernel_compiles_for_hopper_with_the_bulk_prefetch():
    """One bulk prefetch a lane, between the release and the wait with EARLY (pdl.py); after the wait without."""
    for early in (True, False):
        spec = ("_l2_prefetch_kernel", dict(base_ptr="*u8", nbytes="i64"),
                dict(CHUNK=l2_prefetch_triton.CHUNK, LANES=l2_prefetch_triton.LANES, EARLY=early), 1)
        ptx = compile_for_hopper(l2_prefetch_triton, spec).asm["ptx"]
        lines = [line.strip() for line in ptx.splitlines() if "griddepcontrol" in line or "prefetch.L2" in line]
        kinds = [("release" if "launch_dependents" in line else "wait" if "wait" in line else "prefetch")
                 for line in lines]
        assert kinds == (["release", "prefetch", "wait"] if early else ["wait", "release", "prefetch"]), lines
        assert "cp.async.bulk.prefetch.L2.global" in lines[kinds.index("prefetch")]


# ----------------------------------------------------------------------------------------------- CUDA


@requires_hopper
@pytest.mark.parametrize("nbytes", [0, 16, 4096 * 32 + 48, STREAM_MIN_BYTES])
def test_prefetch_changes_nothing_cuda(nbytes):
    """Eagerly and replayed from a CUDA graph (PDL on: it sits between two kernels), the weight and the anchor keep
    their bits; opcheck of the CUDA kernel."""
    weight = torch.randn(N, K, device="cuda").bfloat16()
    before = weight.clone()
    after = torch.randn(64, device="cuda")
    anchor = after.clone()
    ops.l2_prefetch(after, weight, nbytes, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = after * 2
        ops.l2_prefetch(y, weight, nbytes, True)
        z = y + 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(weight, before) and torch.equal(after, anchor) and torch.equal(z, after * 2 + 1)
    torch.library.opcheck(ops.l2_prefetch.default, (after, weight, nbytes, True))


@requires_hopper
def test_prefetch_of_a_slice_cuda():
    stack = torch.randn(3, 64, K, device="cuda").bfloat16()
    before = stack.clone()
    ops.l2_prefetch(torch.zeros(1, device="cuda"), stack[2], stack[2].numel() * 2, False)
    torch.cuda.synchronize()
    assert torch.equal(stack, before)


@requires_hopper
def test_compile_options_install_it_on_hopper(fresh_dynamo):  # noqa: F811
    assert installed(tiny_model().cuda())
    torch._dynamo.reset()
    assert not installed(tiny_model().cuda(), l2_prefetch_bytes=0)
