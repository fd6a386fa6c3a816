"""The compiler passes on CPU: compile small modules with Inductor and count what each pass rewrote."""

import pytest
import torch
from graph_caches import graph_caches_off
from torch._inductor import config as inductor_config

from dsflash_compile import DeepseekV41ForCausalLM, passes, preset_config
from dsflash_compile.passes import rounding
from dsflash_compile.moe import route


@pytest.fixture
def installed():
    """Install the passes for the tiny preset's router (top-2, normalised, x1.5); restore afterwards.
    Inductor's caches are off here: a cache hit would serve the rewritten graph without running (and
    so without counting) the passes."""
    torch._dynamo.reset()
    with graph_caches_off(online_softmax=True, emulate_precision_casts=False,
                          post_grad_custom_post_pass=inductor_config.post_grad_custom_post_pass):
        manager = passes.install(preset_config("tiny").text_config)
        # on CUDA Inductor's online-softmax rewrite would run before our passes and hide the Sinkhorn
        assert inductor_config.post_grad_custom_post_pass is manager and not inductor_config.online_softmax
        assert inductor_config.emulate_precision_casts  # else torch 2.11 drops the rounding the patterns hold
        yield manager
    torch._dynamo.reset()


def router_inputs(tokens, dtype=torch.bfloat16, experts=8, hidden=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=g).to(dtype), torch.randn(experts, hidden, generator=g).bfloat16(),
            torch.randn(experts, generator=g) * 0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_router_fusion_replaces_route(installed, dtype, tokens):
    """route() inside a compiled function becomes one dsflash::fused_router (1 match), same outputs."""

    def f(x, w, b):
        weights, ids = route(x, w, b, 2, True, 1.5)
        return weights * 2, ids

    args = router_inputs(tokens, dtype)
    got, want = torch.compile(f, dynamic=False)(*args), f(*args)
    assert installed.matches["router_fusion"] == 1
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], rtol=1e-6, atol=0)


def test_router_with_other_constants_is_left_alone(installed):
    """A router with another top-k is not this model's pattern: no rewrite, still correct."""

    def f(x, w, b):
        return route(x, w, b, 3, True, 1.5)

    args = router_inputs(5)
    got, want = torch.compile(f)(*args), f(*args)
    assert installed.matches["router_fusion"] == 0
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0])


def test_router_fusion_matches_every_layer_of_the_model(installed):
    """Compiling the tiny model's forward rewrites the router of every one of its 9 MoE layers."""
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(preset_config("tiny")).eval()
    gates = [layer.ffn.gate for layer in model.model.layers]
    x = torch.randn(len(gates), 6, 256).bfloat16()  # one input per layer, as in the model

    def all_routers(x):
        return [gate(x[i]) for i, gate in enumerate(gates)]

    with torch.no_grad():  # inference: no intermediates saved for a backward (they would block the rewrite)
        got, want = torch.compile(all_routers)(x), all_routers(x)
    assert installed.matches["router_fusion"] == len(gates) == 9
    for (gw, gi), (ww, wi) in zip(got, want):
        assert torch.equal(gi, wi) and torch.allclose(gw, ww)


def test_manager_uuid_tracks_options():
    """The cache key changes with the pattern's constants (and is stable for equal ones)."""
    a = passes.DsflashPassManager([passes.RouterFusionPass(2, True, 1.5)])
    b = passes.DsflashPassManager([passes.RouterFusionPass(2, True, 1.5)])
    c = passes.DsflashPassManager([passes.RouterFusionPass(6, True, 1.5)])
    assert a.uuid() == b.uuid() != c.uuid()


def test_fused_router_op():
    """The fused op equals route() and passes opcheck."""
    args = router_inputs(9)
    weights, ids = torch.ops.dsflash.fused_router(*args, 2, True, 1.5)
    want = route(*args, 2, True, 1.5)
    assert torch.equal(ids, want[1]) and torch.equal(weights, want[0])
    torch.library.opcheck(torch.ops.dsflash.fused_router.default, (*args, 2, True, 1.5))


def test_compiled_graphs_keep_the_models_rounding():
    """A single-use fp32 -> bf16 -> fp32 round trip is a rounding point of the model; torch 2.11's joint-graph
    pass deleted it before post-grad passes ran (no mHC seam matched on the H200). After
    keep_model_rounding it reaches the post-grad graph on any torch (on 2.11 without it, it did not)."""
    passes.keep_model_rounding()
    entries = rounding.pointless_convert_entries()
    assert entries, "Inductor's pointless_convert pattern moved: passes/rounding.py no longer applies"
    assert all(entry.extra_check is rounding._not_narrowing for entry in entries)
    seen = []

    def record_casts(graph):
        seen.extend(n.args[1] for n in graph.find_nodes(op="call_function",
                                                         target=torch.ops.prims.convert_element_type.default))

    def round_trip(x):
        return torch.rsqrt((x * 3).to(torch.bfloat16).float() + 1)

    torch._dynamo.reset()
    with graph_caches_off(post_grad_custom_post_pass=record_casts):
        torch.compile(round_trip, fullgraph=True)(torch.rand(64))
    torch._dynamo.reset()
    assert seen == [torch.bfloat16, torch.float32]
