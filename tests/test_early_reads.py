"""Early reads (passes/early_reads.py): dsflash::kv_norm_rope gets early=True, moved after an anchor computed from
its row's producer, where such an anchor precedes the row's first reader; left alone otherwise."""

import pytest
import torch

import dsflash_compile
from dsflash_compile.passes import EarlyReadsPass
from test_compile import fresh_dynamo, tiny_model  # noqa: F401  (fresh_dynamo: a fixture)
from test_kv_norm_rope import CASES, EPS, case_inputs
from test_mhc_fusion import compiling  # noqa: F401  (a fixture)

ops = torch.ops.dsflash


class Recorded:
    """Post-grad pass: EarlyReadsPass, with its count and, per kv_norm_rope, (early, the anchor's name, whether
    the op comes right after its anchor)."""

    def __init__(self):
        self.early, self.counts, self.ops = EarlyReadsPass(), [], []

    def __call__(self, graph):
        self.counts.append(self.early.apply(graph))
        self.ops += [(n.kwargs.get("early", False), n.kwargs.get("after") is not None and n.prev is n.kwargs["after"])
                     for n in graph.find_nodes(op="call_function", target=ops.kv_norm_rope.default)]


def attention_like(x, w, q_w, weight, rot):
    """The attention's order: one projection split into the query's and the key/value row's parts, the row's op,
    the query's path (computed from the projection), then a reader of both."""
    q_a, kv_a = (x @ w).split([64, 512], dim=-1)
    kv = ops.kv_norm_rope(kv_a, weight, EPS, rot, True)
    q = torch.tanh(q_a.float()).to(torch.bfloat16) @ q_w
    return q.float().sum(-1, keepdim=True) * kv.float()


def inputs():
    _, weight, rot = case_inputs(*CASES["decode_release"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 256, generator=g).bfloat16()
    return x, (torch.randn(256, 576, generator=g) / 16).bfloat16(), (torch.randn(64, 64, generator=g) / 8).bfloat16(), \
        weight, rot


def test_the_row_reads_early_after_the_query_path(compiling):  # noqa: F811
    recorded = Recorded()
    args = inputs()
    got = compiling(recorded, attention_like)(*args)
    assert recorded.counts == [1] and recorded.ops == [(True, True)]
    torch.testing.assert_close(got, attention_like(*args), rtol=2e-2, atol=2e-2)


def test_a_row_from_outside_the_graph_is_left_alone(compiling):  # noqa: F811
    """The row is a graph input (its producer ran in an earlier graph): no anchor can be placed after it."""
    def row_only(kv_a, weight, rot, y):
        return ops.kv_norm_rope(kv_a, weight, EPS, rot, True).float() * torch.tanh(y).sum()

    kv, weight, rot = case_inputs(*CASES["decode_release"])
    recorded = Recorded()
    compiling(recorded, row_only)(kv, weight, rot, torch.randn(8))
    assert recorded.counts == [0] and recorded.ops == [(False, False)]


def test_a_row_read_before_any_other_kernel_is_left_alone(compiling):  # noqa: F811
    """Nothing computed from the projection but the row comes before the row's first reader."""
    def row_first(x, w, weight, rot):
        kv = ops.kv_norm_rope((x @ w)[..., 64:], weight, EPS, rot, True)
        return kv.float() * 2

    x, w, _, weight, rot = inputs()
    recorded = Recorded()
    compiling(recorded, row_first)(x, w, weight, rot)
    assert recorded.counts == [0]


def test_compile_options_install_it(fresh_dynamo):  # noqa: F811
    def passes(**options):
        dsflash_compile.compile(tiny_model(), max_batch=2, max_length=32, backend="eager", **options)
        return [type(p).__name__ for p in torch._inductor.config.post_grad_custom_post_pass.passes]

    assert "EarlyReadsPass" not in passes()  # off: it did not pay (12-03 y1)
    assert passes(early_reads=True)[-2:] == ["EarlyReadsPass", "LinearRopePass"]  # linear_rope: on by default
