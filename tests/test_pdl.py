"""Programmatic dependent launch (custom_ops/pdl.py): the switch, the kernels' PTX (the wait comes before any
global memory access), and on a GPU, chains of PDL launches in a CUDA graph giving the plain launches' bits."""

import re

import pytest
import torch

from dsflash_compile.custom_ops import pdl
from hopper import compile_for_hopper

pytest.importorskip("triton")


def test_launch_keywords_follow_the_switch_and_the_device():
    assert pdl.launch(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    try:
        pdl.set_enabled(False)
        assert not pdl.is_enabled() and pdl.launch(torch.device("cpu"))["PDL"] is False
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
            cuda = torch.device("cuda")
            assert pdl.launch(cuda)["launch_pdl"] is False
            pdl.set_enabled(True, streaming=False)
            assert pdl.launch(cuda) == {"PDL": True, "launch_pdl": True}
            assert pdl.launch(cuda, streaming=True) == {"PDL": False, "launch_pdl": False}
    finally:
        pdl.set_enabled(False)  # the default


def _first(ptx: str, pattern: str) -> int:
    match = re.search(pattern, ptx)
    return match.start() if match else len(ptx)


@pytest.mark.parametrize("pdl_on", [True, False])
def test_kernels_wait_before_touching_memory(pdl_on):
    """sm_90 PTX of kernels from three op families: with PDL the first griddepcontrol.wait comes before the first
    global load, store or atomic, and launch_dependents after the wait (a short kernel's at once: before any
    access); without PDL neither appears."""
    from dsflash_compile.custom_ops import bf16_linear_triton, kv_norm_rope_triton, router_triton
    from test_bf16_linear import _KERNEL as LINEAR_ARGS
    from test_kv_norm_rope import _KERNEL as NORM_ARGS
    from test_router_triton import _ARGS as ROUTER_ARGS, _RELEASE as ROUTER_CONSTEXPRS

    specs = [
        (bf16_linear_triton, ("_bf16_linear_kernel", LINEAR_ARGS,
                              dict(QUANT_X=True, ONE_ROW=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, EVEN_K=True,
                                   FP32_DOT=False, PDL=pdl_on), 2)),
        (kv_norm_rope_triton, ("_kv_norm_rope_kernel", NORM_ARGS, dict(D=512, PAIRS=32, QUANT=True, PDL=pdl_on), 4)),
        (router_triton, ("_router_kernel", dict(ROUTER_ARGS, x_ptr="*bf16"),
                         dict(ROUTER_CONSTEXPRS, X_FP32=False, PDL=pdl_on), 4)),
    ]
    for module, spec in specs:
        ptx = compile_for_hopper(module, spec).asm["ptx"]
        wait, release = _first(ptx, r"griddepcontrol\.wait"), _first(ptx, r"griddepcontrol\.launch_dependents")
        memory = _first(ptx, r"\b(ld|st|atom|red)\.global")
        if pdl_on:
            assert wait < memory and wait < release < len(ptx), spec[0]
            if spec[0] != "_bf16_linear_kernel":  # weight streaming: released after its main loop
                assert release < memory, spec[0]
        else:
            assert wait == release == len(ptx), spec[0]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper or later GPU")
def test_pdl_chain_in_a_cuda_graph_gives_the_plain_bits():
    """Dependent bf16_linear GEMVs (each reads the one before) with an RMSNorm-and-RoPE of a slice between,
    captured with PDL and replayed on new inputs: the bits of the same ops launched plainly."""
    from dsflash_compile.custom_ops.bf16_linear_triton import bf16_linear_triton
    from dsflash_compile.custom_ops.kv_norm_rope_triton import kv_norm_rope_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5
               for n, k in ((1792, 5120), (4096, 1792), (5120, 4096), (5120, 5120))]
    norm_weight = torch.rand(512, device="cuda", generator=g).bfloat16() + 0.5
    rot = torch.randn(1, 32, 2, device="cuda", generator=g)
    x = torch.randn(1, 5120, device="cuda", generator=g, dtype=torch.bfloat16)

    def chain():
        y = x
        for w in weights:
            y = bf16_linear_triton(y, w, 1, True)
            if y.shape[-1] == 1792:  # the kv part normalised and rotated, read by nothing but the output
                kv = kv_norm_rope_triton(y[:, 1280:], norm_weight, 1e-6, rot, False)
        return y, kv

    try:
        pdl.set_enabled(True)
        chain()  # compiles the PDL variants before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain()
        pdl.set_enabled(False)
        for _ in range(3):
            x.copy_(torch.randn(1, 5120, device="cuda", generator=g, dtype=torch.bfloat16))
            plain = chain()
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(captured, plain, strict=True))
    finally:
        pdl.set_enabled(False)
