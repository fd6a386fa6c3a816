"""Early reads (passes/early_reads.py): dsflash::kv_norm_rope gets early=True, moved after an anchor computed from
its row's producer, where such an anchor precedes the row's first reader; left alone otherwise. With the gemv option
the one-row projections (dsflash::bf16_gemv, fp32_gemv) get it after the latest projection before them computed from
their input that no other early projection follows, moved up to it and never later."""

import torch

import dsflash_compile
from dsflash_compile.passes import EarlyReadsPass
from graph_caches import graph_caches_off
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
    """After the epilogue folds: the GEMV half on by default (early_gemv, H200 12-05 f1), kv_norm_rope's off
    (early_reads: it did not pay, 12-03 y1); neither, no pass."""
    def passes(**options):
        dsflash_compile.compile(tiny_model(), max_batch=2, max_length=32, backend="eager", **options)
        return [(type(p).__name__, p.options) for p in torch._inductor.config.post_grad_custom_post_pass.passes]

    folds = [("LinearRopePass", {}), ("LinearScalePass", {})]
    assert passes()[-3:] == folds + [("EarlyReadsPass", {"kv_rows": False, "gemv": True})]
    assert passes(early_reads=True)[-1] == ("EarlyReadsPass", {"kv_rows": True, "gemv": True})
    assert passes(early_gemv=False)[-2:] == folds


class RecordedGemv:
    """Post-grad pass: EarlyReadsPass with the one-row projections only; its count and, per projection in graph
    order, (early, its anchor's weight's rows or None, whether it comes right after its anchor)."""

    def __init__(self):
        self.early, self.counts, self.gemvs = EarlyReadsPass(kv_rows=False, gemv=True), [], []

    def __call__(self, graph):
        self.counts.append(self.early.apply(graph))
        for node in graph.nodes:
            if node.target in (ops.bf16_gemv.default, ops.fp32_gemv.default):
                after = node.kwargs.get("after")
                rows = None if after is None else after.args[1].meta["val"].shape[0]
                self.gemvs.append((node.kwargs.get("early", False), rows, after is not None and node.prev is after))


def weights(*rows, k=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(n, k, generator=g) / 8).to(dtype) for n in rows]


def index_layer(x0, w_qkv, w_q, w_idx, w_weights, w_pool):
    """An index and KV-source layer's projections at one row, in the model's order: wq_a + wkv on the normed row,
    the compressor's fp32 projection, the query's norm, the attention's wq_b, the indexer's wq_b and weights_proj."""
    x = torch.tanh(x0.float()).to(torch.bfloat16)  # the seam's normed row
    q_a = ops.bf16_gemv(x, w_qkv, 1, True)[..., :64]
    pooled = ops.fp32_gemv(x, w_pool)
    qr = (q_a.float() * torch.rsqrt(q_a.float().square().mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    q = ops.bf16_gemv(qr, w_q, 1, True)
    index_q = ops.bf16_gemv(qr, w_idx, 1, True)
    scores = ops.bf16_gemv(x, w_weights, 1, False)
    return q.float().sum() + index_q.float().sum() + scores.float().sum() + pooled.sum()


def index_layer_inputs():
    return (torch.randn(1, 64).bfloat16(), *weights(96, 128, 64, 16), *weights(32, dtype=torch.float32))


def test_gemvs_read_early_after_a_projection_before_them(compiling):  # noqa: F811
    """The indexer's wq_b after the attention's (128 rows), the compressor's projection after wq_a + wkv (96 rows);
    weights_proj finds both hosts taken (a projection follows one early projection only) and the ones computed
    from its row before them early: it stays; wq_a + wkv and wq_b have no projection before them from their rows."""
    recorded = RecordedGemv()
    args = index_layer_inputs()
    got = compiling(recorded, index_layer)(*args)
    assert recorded.counts == [2]
    assert recorded.gemvs == [(False, None, False), (True, 96, True), (False, None, False), (True, 128, True),
                              (False, None, False)], recorded.gemvs
    torch.testing.assert_close(got, index_layer(*args), rtol=1e-3, atol=1e-3)


def test_a_gemv_moves_up_to_its_anchor(compiling):  # noqa: F811
    """weights_proj with no compressor: its host is wq_a + wkv, and it moves up to right after it."""
    def layer(x0, w_qkv, w_q, w_idx, w_weights):
        x = torch.tanh(x0.float()).to(torch.bfloat16)
        qr = ops.bf16_gemv(x, w_qkv, 1, True)[..., :64] * 2
        q = ops.bf16_gemv(qr, w_q, 1, True)
        index_q = ops.bf16_gemv(qr, w_idx, 1, True)
        return q.float().sum() + index_q.float().sum() * ops.bf16_gemv(x, w_weights, 1, False).float().sum()

    recorded = RecordedGemv()
    args = index_layer_inputs()[:5]
    got = compiling(recorded, layer)(*args)
    assert recorded.counts == [2]
    assert recorded.gemvs == [(False, None, False), (True, 96, True), (False, None, False), (True, 128, True)], \
        recorded.gemvs  # graph order: weights_proj now second, right after wq_a + wkv
    torch.testing.assert_close(got, layer(*args), rtol=1e-3, atol=1e-3)


def test_a_gemv_on_a_graph_input_or_first_is_left_alone(compiling):  # noqa: F811
    """A row from outside the graph (no producer to order after) and a projection with nothing before it."""
    def two(x, w1, w2):
        return ops.bf16_gemv(x, w1, 1, True).float().sum() + ops.bf16_gemv(x, w2, 1, True).float().sum()

    recorded = RecordedGemv()
    compiling(recorded, two)(torch.randn(1, 64).bfloat16(), *weights(32, 16))
    assert recorded.counts == [0]


def test_options_choose_the_ops():
    """kv_rows and gemv pick what the pass rewrites; both are in its options (the manager's uuid hashes them)."""
    assert EarlyReadsPass().options == {"kv_rows": True, "gemv": False}
    assert EarlyReadsPass(kv_rows=False, gemv=True).options == {"kv_rows": False, "gemv": True}


def test_the_models_decode_graphs_take_the_ordering_passes(fresh_dynamo):  # noqa: F811
    """The tiny model through Inductor with early_gemv and kv_first. In the decode graphs of its index layers the
    indexer's wq_b follows the attention's wq_b and weights_proj a projection of the row (layer 2: wq_a + wkv; the
    ratio-1 source 5: its compressor's wkv there, weights_proj after the index keys' wk; layer 7: wq_a + wkv): 2 + 3 +
    2 early projections (prompt chunks run more rows: bf16_linear, not a GEMV). In every one-row decode graph the key
    row's kernel comes before the query's projection (passes/kv_first.py), 7 graphs, one a block role (qkv_norm_op
    off: its joint kernel makes the key row and wq_b's input together, so the row comes first anyway; the compressors
    on their split path, where the index keys' wk is a projection of its own). generate() gives the eager model's
    tokens."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_model()
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, max_new_tokens=3, do_sample=False)
    with graph_caches_off():  # so the passes run (and count) here
        dsflash_compile.compile(model, max_batch=1, max_length=64, batch_buckets=(1,), prefill_buckets=(16,),
                                early_gemv=True, kv_first=True, qkv_norm_op=False, compress_token_op=False)
        got, codes = run_and_get_code(lambda: model.generate(ids, max_new_tokens=3, do_sample=False))
    matches = model.compiled_runner.pass_manager.matches
    assert matches["early_reads"] == 2 + 3 + 2 and matches["kv_first"] == 7
    assert matches["linear_rope"] == 7  # as without early_gemv: its `after`s come after the folds (12-05 f1)
    assert matches["linear_scale"] == 3  # (on by default) the index layers' weights_proj(x) * scale
    assert torch.equal(got, want)
    decode = [[line for line in code.splitlines() if " = torch.ops.dsflash." in line]  # (the calls)
              for code in codes if "attention_" in code and "kv_norm_rope" in code and "after=buf" in code]
    decode = [calls for calls in decode if any("after=buf" in line and "early=True" not in line for line in calls)]
    assert len(decode) == 7
    for calls in decode:  # the query's projection: the one-row GEMV ordered by an `after`, not reading early
        row = next(i for i, line in enumerate(calls) if "kv_norm_rope" in line)
        query = next(i for i, line in enumerate(calls) if "bf16_gemv" in line and "after=buf" in line
                     and "early=True" not in line)
        assert row < query, calls


def test_a_gemv_whose_row_is_written_in_between_stays():
    """In a graph with the in-place op itself (the post-grad graphs hold such ops' functional form, whose new value a
    later reader reads, so no anchor qualifies there), a one-row projection whose row is rotated in place between
    its anchor and itself does not move up: it would read the row before the write."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def layer(x0, w_a, w_b, rot):
        x = torch.tanh(x0.float()).to(torch.bfloat16)
        a = ops.bf16_gemv(x, w_a, 1, True)
        ops.rope_(x, rot)
        return a.float().sum() + ops.bf16_gemv(x, w_b, 1, True).float().sum()

    def unwritten(x0, w_a, w_b, rot):
        x = torch.tanh(x0.float()).to(torch.bfloat16)
        a = ops.bf16_gemv(x, w_a, 1, True)
        y = (x.float() * 2).to(torch.bfloat16)  # a node between the two, writing nothing
        return a.float().sum() + ops.bf16_gemv(x, w_b, 1, True).float().sum() + y.float().sum()

    args = (torch.randn(1, 1, 64).bfloat16(), *weights(32, 16), torch.randn(1, 1, 8, 2))
    for fn, moved in ((layer, 0), (unwritten, 1)):
        graph = make_fx(fn)(*args).graph
        assert EarlyReadsPass(kv_rows=False, gemv=True).apply(graph) == moved, fn.__name__


def test_mutated_names_the_written_arguments():
    """graph_edit.mutated: the arguments an op's schema marks written (rope_'s x), none for a functional op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dsflash_compile.passes.graph_edit import mutated

    def f(x, rot, w):
        ops.rope_(x, rot)
        return ops.bf16_gemv(x, w, 1, True)

    graph = make_fx(f)(torch.randn(1, 1, 64).bfloat16(), torch.randn(1, 1, 8, 2), *weights(16)).graph
    x = next(n for n in graph.nodes if n.op == "placeholder")
    written = {n.target: mutated(n) for n in graph.nodes if n.op == "call_function"}
    assert written == {ops.rope_.default: [x], ops.bf16_gemv.default: []}
