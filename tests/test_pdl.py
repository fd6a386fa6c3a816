"""Programmatic dependent launch (custom_ops/pdl.py): the switch, the protocol in the sm_90 code of the kernels
without a compile test of their own, and on an sm_90 GPU the same bits with it as without, in CUDA graphs."""

import pytest
import torch

from hopper import check_pdl_protocol, compile_for_hopper
from test_attention import CUDA_SHAPES, op_args, release_inputs
from test_mhc_fusion import seam_args

from dsflash_compile.custom_ops import pdl

ops = torch.ops.dsflash


def test_dependent_launches_only_inside_the_block_and_never_on_cpu():
    cpu = torch.device("cpu")
    assert pdl.launch_options(cpu) == {"PDL": False}
    with pdl.dependent_launches():
        assert not pdl.enabled(cpu)  # the interpreter (CPU tensors) has no grid dependency control
        with pdl.dependent_launches(False):
            assert not pdl._active
        assert pdl._active
    assert not pdl._active


_SUM = dict(out_ptr="*bf16", ids_ptr="*i64", y_ptr="*fp32", T="i32", KK="i32", SLOTS="i32", shared="i32", G="i32",
            D="i32")
_MERGE = dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", sink_ptr="*fp32", pos_ptr="*i64", freq_ptr="*fp32",
              out_ptr="*bf16", nsplit="i32")
_ATTENTION = dict(q_ptr="*bf16", ring_ptr="*u8", chunk_ptr="*bf16", widx_ptr="*i32", comp_ptr="*u8", cidx_ptr="*i32",
                  sink_ptr="*fp32", pos_ptr="*i64", freq_ptr="*fp32", out_ptr="*bf16", part_acc_ptr="*fp32",
                  part_ml_ptr="*fp32", S="i32", K="i32", chunk_sb="i32", ring_sb="i32", ring_sr="i32", comp_sb="i32",
                  comp_sr="i32", scale="fp32", blocks_per_split="i32")
_RECORD = dict(cache_ptr="*u8", rows_ptr="*bf16", slots_ptr="*i64", S="i32", N="i32", c_sb="i32", c_sn="i32",
               c_sd="i32", r_sb="i32", r_ss="i32", r_sd="i32", s_sb="i32", s_ss="i32")


def _kernels():
    from dsflash_compile.custom_ops import attention_triton, records, routed_experts_triton

    return {
        "sum": (routed_experts_triton, ("_sum_kernel", _SUM, dict(BLOCK_N=routed_experts_triton.SUM_BLOCK_N,
                                                                   KK_PAD=8, PDL=True), 4)),
        "merge": (attention_triton, ("_merge_kernel", _MERGE, dict(H=64, D=512, HALF_ROPE=32, NSPLIT=32, PDL=True),
                                     4)),
        "attention": (attention_triton, ("_attention_kernel", _ATTENTION, dict(
            H=64, D=512, W=128, NW=128, HALF_ROPE=32, HG=16, BLOCK_N=32, WIN_FMT=1, CMP_FMT=2, SPLIT=True,
            INTERPRET=False, PDL=True), 8)),
        "record_write": (records, ("_record_write_kernel", _RECORD, dict(DIM=512, FMT=1, G=32, NG=16, NGP=16,
                                                                          DP=512, PDL=True), 4)),
    }


@pytest.mark.parametrize("name", ["sum", "merge", "attention", "record_write"])
def test_kernel_waits_before_any_access(name):
    """Release shapes (decode: 16 heads a program, an FP8 ring, an NVFP4 compressed cache): sm_90 code that waits
    for the kernel before it ahead of every global load, store and atomic, and releases the next one after.
    (The merge kernel keeps a 32-byte stack frame with PDL or without, so spills are not checked here.)"""
    pytest.importorskip("triton")
    module, spec = _kernels()[name]
    check_pdl_protocol(compile_for_hopper(module, spec).asm["ptx"])


# ----------------------------------------------------------------------------------------------- CUDA

requires_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                   reason="needs a CUDA device of compute capability 9.0+ (PDL)")


def _graph(fn, static_inputs):
    """fn(*static_inputs) captured as a CUDA graph with our kernels launched with PDL (warmed up first, which
    compiles them); returns (graph, outputs)."""
    with pdl.dependent_launches():
        assert pdl.enabled(static_inputs[0].device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = fn(*static_inputs)
    return graph, outputs


def _check_replays(fn, make_inputs, rounds=3):
    """The graph's outputs, for fresh inputs copied in each round, equal eager launches without PDL bit for bit."""
    static = make_inputs(0)
    graph, outputs = _graph(fn, static)
    for seed in range(1, rounds + 1):
        fresh = make_inputs(seed)
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        want = fn(*fresh)
        torch.cuda.synchronize()
        for got, expected in zip(outputs, want):
            assert torch.equal(got, expected), f"round {seed}: max |diff| {(got.float() - expected.float()).abs().max()}"


@requires_sm90
def test_a_decode_layers_kernels_with_pdl_give_the_same_bits():
    """Three rounds of seam -> two prefetching GEMVs (18 MB weights) -> router -> routed experts, each reading the
    last one's output, at the release's hidden size: a wait missing or a read hoisted above it shows as other
    bits (the inputs change every replay)."""
    dev = torch.device("cuda")
    dim, experts, inter = 5120, 64, 256
    g = torch.Generator(device=dev).manual_seed(0)

    def weight(*shape):
        return (torch.randn(*shape, device=dev, generator=g) * shape[-1] ** -0.5).bfloat16()

    w_a, w_b, gate = weight(1792, dim), weight(dim, 1792), weight(experts, dim)
    w1, w3, w2 = weight(experts, inter, dim), weight(experts, inter, dim), weight(experts, dim, inter)
    bias = torch.randn(experts, device=dev, generator=g) * 0.1
    _, _, _, _, _, fn, scale, base, norm_weight = (t.to(dev) for t in seam_args((1,), dim=dim))

    def make_inputs(seed):
        return tuple(t.to(dev) for t in seam_args((1,), dim=dim, seed=seed)[:5])

    def layers(out, streams, post, comb, pre_lagged):
        for _ in range(3):
            streams, normed, pre_lagged, post, comb = ops.mhc_seam(out, streams, post, comb, pre_lagged, fn, scale,
                                                                   base, norm_weight, 1e-20, 1e-6, 20)
            a = ops.bf16_linear(normed, w_a, 1, True)
            b = ops.bf16_linear(a, w_b, 1, True)
            weights, ids = ops.fused_router(b, gate, bias, 6, True, 1.5)
            out = ops.routed_experts(b, weights, ids, w1, w3, w2, 10.0, True, True, -1).bfloat16()
        return out, streams, ids

    _check_replays(layers, make_inputs)


@requires_sm90
def test_decode_attention_with_pdl_gives_the_same_bits():
    """The split attention kernel and its merge (batch 1: 16 heads a program), then a record write into the ring
    the next replay reads."""
    dev = torch.device("cuda")
    inp = release_inputs(0, compressed_fmt="nvfp4", **CUDA_SHAPES["decode-b1"])
    for name, value in vars(inp).items():
        if isinstance(value, torch.Tensor):
            setattr(inp, name, value.to(dev))
    slots = torch.tensor([[5]], device=dev)

    def make_inputs(seed):
        fresh = release_inputs(seed, compressed_fmt="nvfp4", **CUDA_SHAPES["decode-b1"])
        return tuple(getattr(fresh, name).to(dev) for name in ("q", "ring", "chunk_kv", "compressed"))

    def attend(q, ring, chunk_kv, compressed):
        out = torch.empty_like(q)
        ops.attention_(out, *op_args(inp, q=q, ring=ring, chunk_kv=chunk_kv, compressed=compressed))
        ops.record_write_(ring, out[:, :, 0], slots, "fp8")
        return out, ring

    _check_replays(attend, make_inputs)
