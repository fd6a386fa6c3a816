"""dsflash_compile.compile on CPU: generate() through the compiled runner equals the eager model, blocks of
one role share one graph, and nothing recompiles after warm-up (torch._dynamo counters).

Most tests use the "eager" backend (Dynamo capture with fullgraph, no code generation) so they check the
graphs and guards in seconds; one test runs Inductor with our passes on the tiny model.
"""

import pytest
import torch
from graph_caches import graph_caches_off
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

import dsflash_compile
from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.cache import CacheCapacityError
from dsflash_compile.piecewise_graph import piece_sizes


@pytest.fixture
def fresh_dynamo():
    """Inductor settings and Dynamo cache limits compile() changes are restored afterwards."""
    torch._dynamo.reset()
    counters.clear()
    limits = torch._dynamo.config
    with inductor_config.patch(post_grad_custom_post_pass=inductor_config.post_grad_custom_post_pass,
                               online_softmax=inductor_config.online_softmax,
                               emulate_precision_casts=inductor_config.emulate_precision_casts), \
            limits.patch(cache_size_limit=limits.cache_size_limit,
                         accumulated_cache_size_limit=limits.accumulated_cache_size_limit):
        yield
    torch._dynamo.reset()


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return DeepseekV41ForCausalLM(preset_config("tiny", **overrides)).eval()


def prompts(batch, length, seed=1):
    return torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def compiled_with_op_counted(op: str, reference, **options):
    """The tiny model on a 2 x 12 prompt, eager and through compile(**options) (eager backend) with dsflash::`op`
    running `reference` on the CPU, counted: (model, eager logits, compiled logits, the op's calls)."""
    model = tiny_model()
    ids = prompts(2, 12)
    want = model(ids).logits
    dsflash_compile.compile(model, max_batch=2, max_length=32, backend="eager", **options)
    calls = []
    with torch.library._scoped_library("dsflash", "IMPL") as lib:
        lib.impl(op, lambda *args: (calls.append(1), reference(*args))[-1], "CPU")
        got = model(ids, cache=model.compiled_runner.fresh_cache(2, 32)).logits
    return model, want, got, calls


def distinct_roles(model, layers=None) -> int:
    """Roles as the compiled block sees them (layer ids excluded: blocks get their tensors as arguments), with
    what it is handed (expanded streams at block 0 and after Engram, else the block before's PendingPost) and
    whether it is the last (which expands its own output), over `layers` (a slice of the layer list; default
    all)."""
    blocks = model.model.layers[layers or slice(None)]
    return len({(b.role.ratio, b.role.is_kv_source, b.role.is_index_source, b.role.is_candidate_source,
                 b.role.uses_candidates, b.role.layer == 0 or b.engram is not None, b.last) for b in blocks})


def compiled_modules(model, layers=slice(None)) -> int:
    """Graphs one shape compiles over `layers`: one per role, and with compile_engram one per Engram module
    (their tables differ in rows, so each has its own)."""
    engram = model.compiled_runner.options.compile_engram
    return distinct_roles(model, layers) + engram * sum(b.engram is not None for b in model.model.layers[layers])


def prefill_and_decode_graphs(model) -> int:
    """Graphs of one prefill bucket longer than the window and one decode batch: every layer at the bucket's
    length (prompts up to the window are not trimmed), the layers after the last KV source at the window's
    length and the last KV source with the window's queries only (longer prompts: bounded replay) or none (a
    chunk before the last), every layer at one token."""
    cut = model.model.text_config.last_kv_source_layer + 1
    setup = model.compiled_runner.options.compile_setup  # one set-up graph per shape
    # with compile_finish a collapse and an advance per shape, and the collapse of the trimmed window's
    finish = model.compiled_runner.options.compile_finish
    return 2 * (compiled_modules(model) + setup + 2 * finish) + compiled_modules(model, slice(cut, None)) + finish + 2


@torch.no_grad()
def test_compiled_generate_equals_eager_and_never_recompiles(fresh_dynamo):
    model = tiny_model()
    ids = prompts(4, 20)
    want = model.generate(ids, max_new_tokens=12, do_sample=False)
    dsflash_compile.compile(model, max_batch=4, max_length=256, batch_buckets=(4,), prefill_buckets=(32,),
                            backend="eager", passes=False)
    model.compiled_runner.warm_up()  # compiles both shapes now; generate() then compiles nothing new
    got = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)  # a full batch bucket: the same shapes, so the same numbers
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == prefill_and_decode_graphs(model)
    assert not counters["graph_break"]

    # A long generation, and a batch of 3 inside the bucket of 4 (padded with inert rows): no new graph.
    long = model.generate(ids[:3, :8], max_new_tokens=240, min_new_tokens=240, do_sample=False)
    assert long.shape == (3, 248)
    assert counters["stats"]["unique_graphs"] == graphs


@torch.no_grad()
def test_one_row_generate_compiles_nothing_after_warm_up(fresh_dynamo):
    """A one-row prompt's chunks (40 tokens: 8 + 32, the first stopping at the last KV source's cache writes)
    and decode steps are column views of generate()'s sequence, whose stride is its length: the compiled
    set-up guards on it, so the runner hands it fresh copies; warm_up() compiled every chunk kind."""
    model = tiny_model()
    dsflash_compile.compile(model, max_batch=1, max_length=64, batch_buckets=(1,), prefill_buckets=(16, 32),
                            backend="eager", passes=False)
    model.compiled_runner.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    model.generate(prompts(1, 40), max_new_tokens=4, do_sample=False)
    assert counters["stats"]["unique_graphs"] == graphs


@torch.no_grad()
def test_a_cache_of_its_own_runs_the_blocks_eager(fresh_dynamo):
    """The graphs belong to the runner's cache: calls with other caches (any batch, length) give the
    uncompiled model's logits and compile nothing (before, each recompiled every block, up to Dynamo's limit).
    The eager stance ends with the call."""
    model = tiny_model()
    shapes = [(2, 20), (3, 9), (1, 30), (4, 17)]

    def logits():
        return [model(prompts(b, s), cache=model.new_cache(b, s + 4)).logits for b, s in shapes]
    want = logits()
    dsflash_compile.compile(model, max_batch=4, max_length=64, batch_buckets=(4,), prefill_buckets=(32,),
                            backend="eager", passes=False)
    for got, expected in zip(logits(), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 0
    model(prompts(4, 1), cache=model.compiled_runner.fresh_cache(4, 8))  # the runner's cache: its graphs
    assert counters["stats"]["unique_graphs"] > 0


def test_each_compiled_model_gets_room_for_its_graphs(fresh_dynamo):
    """All models' blocks share one code object and so one Dynamo cache: each compile() adds room for its own
    graphs. A limit sized for one model stopped the third model of other shapes in parallel_check (a reference
    and two sharded copies); warming up three tiny models of batch 1, 2, 3 failed the same way (43 graphs
    against 32), but takes 80 s, so this checks the room."""
    torch._dynamo.config.cache_size_limit, torch._dynamo.config.accumulated_cache_size_limit = 8, 256  # defaults
    limits = []
    for batch in (1, 2, 3):  # the same buckets, so the same room each
        dsflash_compile.compile(tiny_model(), max_batch=batch, max_length=64, batch_buckets=(batch,),
                                prefill_buckets=(32,), backend="eager", passes=False)
        limits.append((torch._dynamo.config.cache_size_limit, torch._dynamo.config.accumulated_cache_size_limit))
    room = limits[0][0] - 8
    assert room > 0 and limits == [(8 + k * room, 256 + k * room) for k in (1, 2, 3)]


@torch.no_grad()
def test_dynamic_shapes_reuse_one_graph_from_the_second_batch_bucket_on(fresh_dynamo):
    """dynamic_shapes: the first batch bucket compiles static graphs, the second symbolic ones that the third
    reuses (decode steps; graphs counted), and the numbers stay the eager model's. The MoE's few-rows cutoff
    lies between the second and third buckets: the grouped GEMM is picked when it runs, not by a guard on the
    batch (on the H200 flash-40l-e8 recompiled every block at batch 32 after 8: 7 rows a token, cutoff 112)."""
    model = tiny_model()
    ids = prompts(4, 1)
    want = model(ids, cache=model.new_cache(4, 64)).logits
    pairs = model.config.text_config.num_experts_per_tok + 1  # per token: the shared expert is stacked, one more
    dsflash_compile.compile(model, max_batch=4, max_length=64, batch_buckets=(2, 3, 4), prefill_buckets=(16,),
                            backend="eager", passes=False, dynamic_shapes=True, moe_few_rows=3 * pairs)
    graphs = []
    for batch in (2, 3, 4):
        got = model(ids[:batch], cache=model.compiled_runner.fresh_cache(batch, 64)).logits
        torch.testing.assert_close(got, want[:batch], rtol=0, atol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] > graphs[0] and graphs[2] == graphs[1], graphs


@pytest.mark.parametrize("dynamic_shapes", [False, True])
@pytest.mark.parametrize("inductor_pdl", [False, True])
def test_inductor_options_are_known(fresh_dynamo, monkeypatch, dynamic_shapes, inductor_pdl):
    """With Inductor, dynamic_shapes turns off its coalesce tiling analysis (which fails on symbolic sizes) and
    inductor_pdl turns on its PDL launches (where this torch has the option): torch.compile checks the options'
    names when the blocks are wrapped, before anything runs. The set-up (begin) adds its combo kernels
    (setup_combo_kernels, on by default)."""
    options, compile_ = [], torch.compile

    def record(fn, **kwargs):
        options.append((getattr(fn, "__name__", None), kwargs.get("options")))
        return compile_(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", record)
    dsflash_compile.compile(tiny_model(), max_batch=2, max_length=64, batch_buckets=(1, 2), prefill_buckets=(16,),
                            dynamic_shapes=dynamic_shapes, inductor_pdl=inductor_pdl)
    want = {"triton.coalesce_tiling_analysis": False} if dynamic_shapes else {}
    if inductor_pdl and hasattr(inductor_config.triton, "enable_pdl"):
        want["triton.enable_pdl"] = True
    assert options and all(o == ({**want, "combo_kernels": True} if name == "begin" else want or None)
                           for name, o in options), options
    assert [name for name, _ in options].count("begin") == 1


@torch.no_grad()
def test_padded_batch_rows_are_inert(fresh_dynamo):
    """Rows padded up to the bucket change nothing but GEMM shapes: logits equal within fp32 rounding (with
    the Engram modules compiled too: compile_engram)."""
    model = tiny_model()
    ids = prompts(3, 10)
    want = model(ids).logits
    dsflash_compile.compile(model, max_batch=4, max_length=64, batch_buckets=(4,), prefill_buckets=(16,),
                            backend="eager", passes=False, compile_engram=True)
    got = model(ids, cache=model.compiled_runner.fresh_cache(3, 64)).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    engrams = [b.engram for b in model.model.layers if b.engram is not None]
    assert engrams and all(e._compiled_call_impl is not None for e in engrams)
    # one prefill shape: roles, Engrams, the set-up and the finish (collapse, advance)
    options = model.compiled_runner.options
    assert counters["stats"]["unique_graphs"] == compiled_modules(model) + options.compile_setup + 2 * options.compile_finish


@torch.no_grad()
@pytest.mark.parametrize("replay", [True, False])
def test_long_prompt_runs_in_chunks_of_the_largest_bucket(fresh_dynamo, replay):
    """40 tokens in chunks of 8 + 16 + 16 (the last chunk holds the last window): the same last logits as
    one eager forward, with bounded replay (the chunks before the last stop at the cut, the last one trims)
    and without."""
    model = tiny_model(swa_bounded_replay=replay)
    ids = prompts(2, 40)
    cache = model.new_cache(2, 64)
    want = model(ids, cache=cache, logits_to_keep=1).logits
    dsflash_compile.compile(model, max_batch=2, max_length=64, batch_buckets=(2,), prefill_buckets=(16,),
                            backend="eager", passes=False)
    runner_cache = model.compiled_runner.fresh_cache(2, 64)
    got = model(ids, cache=runner_cache, logits_to_keep=1).logits
    assert runner_cache.get_seq_length() == 40 and runner_cache.lengths[:2].tolist() == [40, 40]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


class ReplayedStep:
    """A CPU stand-in for a captured CUDA graph: replay() reruns the captured step on its static inputs and
    writes into the output the capture returned (a real graph writes there too)."""

    def __init__(self, step, out):
        self.step, self.out = step, out

    def replay(self):
        out = self.step()
        if self.out is not None:
            self.out.copy_(out)


@torch.no_grad()
def test_prefill_chunk_graphs_key_their_inputs_and_outputs(fresh_dynamo, monkeypatch):
    """The prefill chunk graphs' bookkeeping, on the CPU with a stand-in for capture: 2 x 24-token prompts in
    chunks of 8 + 16 columns, both graphs (at most 32 tokens): the first stops at the cut (tail 0), the last
    runs the trimmed layers on the 16-column window. One graph per (shape, tail, prefix-cache hit or not); a
    second prompt replays them with its own inputs and gets the same logits as the blocks launched one by one
    (a stale static input or an output rewritten by the next replay would not)."""
    model = tiny_model()
    dsflash_compile.compile(model, max_batch=2, max_length=64, batch_buckets=(2,), prefill_buckets=(8, 16),
                            backend="eager", passes=False, prefill_graph_tokens=32, compile_setup=False,
                            compile_engram=False)  # fewer graphs to trace: neither changes the bookkeeping
    runner = model.compiled_runner

    def capture(step):  # a capture records without running: the cache is left as it was
        saved = runner.cache.save_state()
        out = step()
        runner.cache.restore_state(saved)
        return ReplayedStep(step, out), out

    def last_logits(ids, graphs):
        runner.cuda_graphs = graphs
        return model(ids, cache=runner.fresh_cache(2, 64), logits_to_keep=1).logits

    monkeypatch.setattr(runner, "_capture", capture)
    for seed in (1, 2):
        ids = prompts(2, 24, seed=seed)
        got = last_logits(ids, True)
        assert torch.equal(got, last_logits(ids, False)), seed
    assert sorted(runner.chunk_graphs) == [((2, 8), 0, True), ((2, 16), 16, True)]  # (shape, tail, no hit)


def test_chunk_plan_splits_the_remainder_where_padding_costs_more():
    from dsflash_compile.compiled import chunk_plan

    buckets = [16, 64, 256, 1024, 4096]
    assert chunk_plan(8192, buckets, 128) == [4096, 4096]
    assert chunk_plan(33792, buckets, 128) == [1024] + [4096] * 8  # the remainder first, whole chunks after
    # a prefix-cache hit's replay (128) + 1024 new tokens: two chunks, not one padded to 4096
    plan = chunk_plan(1152, buckets, 128)
    assert sum(plan) == 1152 and len(plan) == 2 and plan[-1] >= 128
    assert chunk_plan(200, buckets, 128) == [200]  # splitting would cost more launches than padding saves
    # with bounded replay the last chunk must hold the window: 36 = 4 + 16 + 16 would end on 16 < 32
    assert chunk_plan(36, [4, 16, 64], None, overhead=0) == [4, 4, 4, 4, 4, 16]
    assert chunk_plan(36, [4, 16, 64], 32, overhead=0) == [36]


@torch.no_grad()
def test_inductor_with_passes_matches_eager(fresh_dynamo):
    """The real thing on CPU: Inductor code generation with our passes (fused router and mHC seams). Native
    weights ran here too until CI time ran short (87 s; they matched the same patterns and logits):
    test_native_weights.py compiles the native model without graph breaks."""
    model = tiny_model()
    ids = prompts(2, 12)
    want = model(ids).logits
    with graph_caches_off():  # so the passes run (and count) here
        dsflash_compile.compile(model, max_batch=2, max_length=64, batch_buckets=(2,), prefill_buckets=(16,))
        got = model(ids, cache=model.compiled_runner.fresh_cache(2, 64)).logits
    matches = model.compiled_runner.pass_manager.matches
    assert matches["router_fusion"] == distinct_roles(model)  # one graph per role, one router each
    assert matches["mhc_fusion"] == 2 * distinct_roles(model)  # both seams of every block graph
    # Inductor may reassociate fp32 sums (a last-bit change can move an FP8 step), so not bits; in
    # practice on this CPU the logits agree to ~1e-6.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)


def test_compile_refuses_what_it_cannot_capture(fresh_dynamo):
    with pytest.raises(ValueError, match="emulate_reference_index_key_pointer"):
        dsflash_compile.compile(tiny_model(emulate_reference_index_key_pointer=True), backend="eager")
    with pytest.raises(ValueError, match="batch_buckets"):
        dsflash_compile.compile(tiny_model(), batch_buckets=(4, 2), backend="eager")
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        dsflash_compile.compile(tiny_model(), prefill_graph_tokens=-1, backend="eager")
    with pytest.raises(ValueError, match="decode_graph_pieces=0"):
        dsflash_compile.compile(tiny_model(), decode_graph_pieces=0, backend="eager")
    with pytest.raises(ValueError, match="decode_graph_growth=0.5"):
        dsflash_compile.compile(tiny_model(), decode_graph_growth=0.5, backend="eager")


def test_decode_graph_pieces_grow():
    """The decode graph's pieces in blocks: every block in one piece, the first piece one block (its launch is
    all the GPU waits for), none smaller than the one before; growth 1 gives even pieces."""
    assert piece_sizes(40, 7, 2.0) == [1, 2, 2, 3, 5, 9, 18]
    assert piece_sizes(40, 4, 1.0) == [10, 10, 10, 10]
    for blocks in (1, 3, 9, 40, 61):
        for pieces in (1, 2, 4, 7, 9):
            for growth in (1.0, 1.5, 2.0, 4.0):
                sizes = piece_sizes(blocks, pieces, growth)
                assert sum(sizes) == blocks and len(sizes) == min(pieces, blocks), (blocks, pieces, growth)
                assert min(sizes) >= 1 and sizes == sorted(sizes), (blocks, pieces, growth, sizes)
                assert growth == 1.0 or pieces > blocks or sizes[0] <= max(1, blocks // pieces)
    model = dsflash_compile.compile(tiny_model(), max_batch=2, max_length=32, backend="eager", passes=False)
    with pytest.raises(CacheCapacityError, match="max_batch=2"):
        model.generate(prompts(3, 8), max_new_tokens=2, do_sample=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode CUDA graphs need a GPU")
@pytest.mark.parametrize("chunk_graph", [False, True])
@torch.no_grad()
def test_cuda_graph_decode_follows_eager(fresh_dynamo, chunk_graph):
    """On a GPU, teacher-forced prefill (20 tokens, longer than the 16-token window: bounded replay trims)
    + 8 decode steps:
    - the captured decode graph (in four pieces) and the prefill chunk's graph (2 x 32 tokens; or, with prefill
      chunk graphs off, the trimmed layers' graph) give the same bits as the same compiled blocks run without graphs
      (capture, replay and the cache restore around the warm-ups are exact), one graph per shape each;
    - compiled and eager agree within rounding: Inductor reorders fp32 sums, which can move an FP8/FP4
      quantization step, and on this random tiny model that moves logits by up to ~0.1 (the golden
      fixture's arithmetic-order probe allows 1.8); a real error (a stale row, a wrong position) is O(1)."""
    model = tiny_model().cuda()
    ids = prompts(2, 28).cuda()

    def teacher_forced(cache):
        logits = [model(ids[:, :20], cache=cache, logits_to_keep=1).logits]
        return logits + [model(ids[:, t:t + 1], cache=cache).logits for t in range(20, 28)]

    want = teacher_forced(model.new_cache(2, 64))
    dsflash_compile.compile(model, max_batch=2, max_length=64, batch_buckets=(2,), prefill_buckets=(32,),
                            prefill_graph_tokens=64 if chunk_graph else 0)
    runner = model.compiled_runner
    got = teacher_forced(runner.fresh_cache(2, 64))
    assert list(runner.graphs) == [2]
    assert len(runner.graphs[2][0].graphs) == 7  # decode_graph_pieces: seven graphs replayed back to back
    assert (len(runner.chunk_graphs), len(runner.trimmed.graphs)) == ((1, 0) if chunk_graph else (0, 1))
    # the first pass captured the graphs; a second replays them (tiny's layer 7 is an index source after
    # the cut: its top-k must not shift the trimmed graph's static inputs)
    again = teacher_forced(runner.fresh_cache(2, 64))
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    runner.cuda_graphs = False
    without_graph = teacher_forced(runner.fresh_cache(2, 64))
    for step, (g, n, w) in enumerate(zip(got, without_graph, want)):
        assert torch.equal(g, n), step
        rel = ((g - w).norm() / w.norm()).item()
        print(f"step {step}: rel L2 vs eager {rel:.2e}, max abs {(g - w).abs().max().item():.3f}")
        assert rel <= 0.1, step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode CUDA graphs need a GPU")
@torch.no_grad()
def test_decode_graph_in_pieces_gives_the_blocks_bits(fresh_dynamo):
    """The decode step captured as 1, 3 and 9 graphs (tiny has 9 blocks: a cut before every block), and as 3
    with the set-up in a piece of its own (4 graphs), replays the bits of the blocks run without graphs, step
    after step (the pieces share one pool: replayed in capture order, no piece reads memory a later one reused).
    Eager-backend blocks: graphs are what is tested."""
    ids = prompts(2, 14).cuda()
    logits = {}
    for pieces, setup_piece in ((1, False), (3, False), (3, True), (9, False), (0, False)):  # 0: no graphs
        model = tiny_model().cuda()
        # graphs of eager-backend set-up and Engram code would copy their constants from the host at every call
        # (Dynamo traces through their lru_cache), which a capture refuses: those stay uncompiled, the prompt
        # runs without a chunk graph
        dsflash_compile.compile(model, max_batch=2, max_length=32, batch_buckets=(2,), prefill_buckets=(16,),
                                backend="eager", passes=False, decode_graph_pieces=max(pieces, 1),
                                compile_setup=False, compile_engram=False, prefill_graph_tokens=0,
                                decode_graph_setup_piece=setup_piece)
        runner = model.compiled_runner
        runner.cuda_graphs = pieces > 0
        cache = runner.fresh_cache(2, 32)
        steps = [model(ids[:, :8], cache=cache, logits_to_keep=1).logits]
        steps += [model(ids[:, t:t + 1], cache=cache).logits for t in range(8, 14)]
        if pieces:
            assert len(runner.graphs[2][0].graphs) == pieces + setup_piece
        logits[pieces, setup_piece] = steps
    for key in logits:
        assert all(torch.equal(a, b) for a, b in zip(logits[key], logits[0, False])), key


@torch.no_grad()
def generate_with_op_counted(op: str, run, batch: int, **options):
    """The tiny model's greedy 6 tokens after a batch x 12 prompt, eager and through compile(**options) (eager
    backend) with dsflash::`op` running `run(calls, *args)` on the CPU: (model, eager tokens, compiled, calls)."""
    model = tiny_model()
    ids = prompts(batch, 12)
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    dsflash_compile.compile(model, max_batch=batch, max_length=64, batch_buckets=(batch,), prefill_buckets=(16,),
                            backend="eager", passes=False, **options)
    calls = []
    with torch.library._scoped_library("dsflash", "IMPL") as lib:
        lib.impl(op, lambda *args: run(calls, *args), "CPU")
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
    return model, want, got, calls


@pytest.mark.parametrize("joint", [False, True])
def test_decode_writes_the_window_ring_with_the_norm(fresh_dynamo, joint):
    """decode_ring_write_op: every layer of a one-token step runs dsflash::kv_norm_rope_write_ (with qkv_norm_op
    qkv_norm_rope_write_: the query's norm in that launch too), the ring written before the attention, and
    generate() gives the eager model's tokens; prompt chunks write it after."""
    from dsflash_compile.custom_ops.kv_norm_rope import kv_norm_rope_reference, qkv_norm_rope_reference
    from dsflash_compile.custom_ops.records import record_write_reference

    def write(calls, ring, slots, fmt, *args):
        calls.append(args[-5].shape[1])  # kv's columns
        out = qkv_norm_rope_reference(*args) if joint else kv_norm_rope_reference(*args)
        record_write_reference(ring, out[1] if joint else out, slots, fmt)
        return out

    op = "qkv_norm_rope_write_" if joint else "kv_norm_rope_write_"
    model, want, got, calls = generate_with_op_counted(op, write, 2, decode_ring_write_op=True, qkv_norm_op=joint)
    assert torch.equal(got, want)
    assert calls == [1] * 5 * len(model.model.layers)  # the 5 steps after the prompt's


@torch.no_grad()
def test_decode_attention_makes_its_own_key(fresh_dynamo):
    """attention_own_key: every layer of a one-token step runs dsflash::attention_own_key_ (made early: wq_a and wkv
    are one projection) and no key-row op of its own (the row made and written to the ring in the attention's
    launch), and generate() gives the eager model's tokens."""
    from dsflash_compile.custom_ops.attention_own_key import attention_own_key_reference

    model = tiny_model()
    ids = prompts(2, 12)
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    dsflash_compile.compile(model, max_batch=2, max_length=64, batch_buckets=(2,), prefill_buckets=(16,),
                            backend="eager", passes=False, attention_own_key=True)
    calls = []

    def attend(*args):
        calls.append((args[3].shape[1], args[-1]))  # kv's columns, early
        attention_own_key_reference(*args[:-1])

    def refuse(*args):
        raise AssertionError("a key-row op ran beside attention_own_key_")

    with torch.library._scoped_library("dsflash", "IMPL") as lib:
        lib.impl("attention_own_key_", attend, "CPU")
        for op in ("kv_norm_rope_write_", "qkv_norm_rope_write_"):
            lib.impl(op, refuse, "CPU")
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert calls == [(1, True)] * 5 * len(model.model.layers)  # the 5 steps after the prompt's


def test_setup_combo_kernels_reach_the_setup_compile_only(fresh_dynamo, monkeypatch):
    """setup_combo_kernels: the set-up (DeepseekV41Model.begin) is compiled with Inductor's combo_kernels, the blocks,
    Engram modules and the finish without (torch.compile's calls recorded; nothing compiles), and only on Inductor."""
    calls = []

    def record(fn, **kwargs):
        calls.append((fn.__name__, kwargs.get("options", {})))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    for backend, combo in (("inductor", {"begin"}), ("eager", set())):
        calls.clear()
        dsflash_compile.compile(tiny_model(), max_batch=1, max_length=32, setup_combo_kernels=True, backend=backend)
        assert {name for name, options in calls if options.get("combo_kernels")} == combo
        assert {"begin", "collapse", "advance", "_call_impl"} <= {name for name, _ in calls}


def test_compressor_gemv_fuses_wkv_and_wgate(fresh_dynamo):
    """compressor_gemv: each ratio > 1 KV source's wkv and wgate run as one dsflash::fp32_gemv a decode step (their
    fused weight; prompts through F.linear), and generate() gives the eager model's tokens."""
    from dsflash_compile.custom_ops.fp32_gemv import fp32_gemv_reference

    def gemv(calls, x, weight):
        calls.append(tuple(weight.shape))
        return fp32_gemv_reference(x, weight)

    model, want, got, calls = generate_with_op_counted("fp32_gemv", gemv, 1, compressor_gemv=True)
    assert torch.equal(got, want)
    config = model.model.text_config
    pooled = sum(role.is_kv_source and role.ratio > 1 for role in config.layer_roles)
    assert pooled and calls == [(2 * config.head_dim, config.hidden_size)] * 5 * pooled


def test_engram_lookup_op_reads_the_table(fresh_dynamo):
    """engram_lookup_op: every Engram layer reads its table rows through dsflash::engram_lookup, prompt and decode
    steps alike, and generate() gives the eager model's tokens."""
    from dsflash_compile.custom_ops.engram_lookup import engram_lookup_reference

    def lookup(calls, weight, scale, ids):
        calls.append(ids.shape[1])
        return engram_lookup_reference(weight, scale, ids)

    model, want, got, calls = generate_with_op_counted("engram_lookup", lookup, 1, engram_lookup_op=True)
    assert torch.equal(got, want)
    engrams = sum(block.engram is not None for block in model.model.layers)
    assert engrams and calls == [16] * engrams + [1] * 5 * engrams  # the prompt padded to its bucket, 5 steps
