"""dsflash::attention_own_key_ (custom_ops/attention_own_key.py): a one-token step's attention that makes the
token's key row and writes it to the window ring in its own launch.

The reference is the two ops it replaces (kv_norm_rope_write_, then attention_); the Triton launch (attention_triton
with own_key) gives the bits of the two launches it replaces (kv_norm_rope_triton's ring write, then
attention_triton on its key row), under the interpreter and on CUDA (eagerly and in a CUDA graph), the key made
before the PDL wait or after it; every other ring slot is left as it was; it compiles for sm_90 without spills and
stores nothing before its wait; opcheck and errors; the tiny model's decode graphs through Inductor take it."""

import math
from types import SimpleNamespace

import pytest
import torch
from graph_caches import graph_caches_off
from interp import report_each, requires_interpreter, run_interpreted
from test_attention import as_cache, decode_launch_ptx, distinct_picks, gen, interpreter_tolerance, on_grid
from test_compile import fresh_dynamo, tiny_model  # noqa: F401  (fresh_dynamo: a fixture)

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.custom_ops.attention import attention_reference
from dsflash_compile.custom_ops.attention_own_key import attention_own_key_reference
from dsflash_compile.custom_ops.kv_norm_rope import kv_norm_rope_reference
from dsflash_compile.custom_ops.records import record_write_reference
from dsflash_compile.rope import rotation

ops = torch.ops.dsflash
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
EPS = 1e-6


def decode_inputs(seed, *, batch=3, heads=4, dim=64, window=16, n_comp=48, k=24, pairs=8, window_fmt="fp8",
                  compressed_fmt="nvfp4", lengths=None, width=96, quantize=True, ratio0=False, device="cpu"):
    """One decode step's inputs as the model makes them (context.build_context's window lists): row 0 is a padding
    row (position -1: no key, no ring write), the others at `lengths` tokens (default: one inside its first window,
    the rest past it), each a key projection taken as the last `dim` of `width` columns (a strided view)."""
    g = gen(seed)
    bmax = batch + 1
    lengths = torch.tensor(lengths or [0, 5] + [40 + 7 * i for i in range(batch - 2)])
    positions = torch.where(torch.arange(batch) == 0, -1, lengths).view(batch, 1)
    key_pos = (positions - window + 1).clamp_min(0).unsqueeze(-1) + torch.arange(window)
    in_ring = key_pos < lengths.view(batch, 1, 1)
    idx = torch.where(in_ring, key_pos % window, window + key_pos - lengths.view(batch, 1, 1))
    widx = torch.where((key_pos <= positions.unsqueeze(-1)) & (positions.unsqueeze(-1) >= 0), idx, -1)
    cidx = distinct_picks(g, batch, 1, n_comp, k).masked_fill(torch.rand(batch, 1, k, generator=g) < 0.3, -1)
    cidx[0] = -1
    inv_freq = 1.0 / 10000 ** (torch.arange(pairs, dtype=torch.float32) / pairs)
    ring = as_cache(on_grid(torch.randn(bmax, window, dim, generator=g), window_fmt, dim), window_fmt)
    compressed = as_cache(on_grid(torch.randn(bmax, n_comp, dim, generator=g), compressed_fmt, dim), compressed_fmt)
    if ratio0:
        compressed, cidx, compressed_fmt = ring[:, :0], cidx[..., :0], window_fmt
    inp = SimpleNamespace(
        q=torch.randn(batch, 1, heads, dim, generator=g).bfloat16(), ring=ring,
        kv=torch.randn(batch, 1, width, generator=g).bfloat16()[..., width - dim:],
        weight=(torch.rand(dim, generator=g) + 0.5).bfloat16(), eps=EPS,
        rot=rotation(positions.clamp_min(0), inv_freq), quantize=quantize,
        slots=torch.where(positions >= 0, positions % window, -1), widx=widx.to(torch.int32), compressed=compressed,
        cidx=cidx.to(torch.int32), sink=torch.rand(heads, generator=g) * 3 - 1 + math.log((window + k) / 10),
        positions=positions, inv_freq=inv_freq, scale=dim ** -0.5, window_fmt=window_fmt,
        compressed_fmt=compressed_fmt)
    for name, value in vars(inp).items():
        if isinstance(value, torch.Tensor):
            setattr(inp, name, value.to(device))
    return inp


OP_ARGS = ("ring", "q", "kv", "weight", "eps", "rot", "quantize", "slots", "widx", "compressed", "cidx", "sink",
           "positions", "inv_freq", "scale", "window_fmt", "compressed_fmt")


def op_args(inp):
    return tuple(getattr(inp, name) for name in OP_ARGS)


CASES = {  # decode_inputs kwargs + num_splits (None: the launch's own count) and early
    "fp8-nvfp4-splits": dict(num_splits=None, early=False, seed=1),
    "fp8-nvfp4-early": dict(num_splits=None, early=True, seed=2),
    "fp8-fp8-one-split": dict(compressed_fmt="fp8", num_splits=1, early=True, seed=3),
    "bf16-ring-unquantized-3-splits": dict(window_fmt="bf16", compressed_fmt="bf16", quantize=False, num_splits=3,
                                           early=False, seed=4),
    "ratio0-fp8": dict(ratio0=True, num_splits=None, early=True, seed=5),
    "20-heads-32-slot-window": dict(heads=20, window=32, lengths=[0, 31, 32, 90], batch=4, num_splits=None,
                                    early=False, seed=6),
}


def two_launches(inp, attention_triton, kv_norm_rope_triton, **launch):
    """(out, ring) of the launches the op replaces: kv_norm_rope_triton's ring write, attention_triton on its row."""
    ring = inp.ring.clone()
    key = kv_norm_rope_triton(inp.kv, inp.weight, inp.eps, inp.rot, inp.quantize, ring=ring, slots=inp.slots,
                              fmt=inp.window_fmt)
    out = torch.full_like(inp.q, math.nan)
    attention_triton(out, inp.q, ring[:inp.q.shape[0]], key, inp.widx, inp.compressed, inp.cidx, inp.sink,
                     inp.positions, inp.inv_freq, inp.scale, inp.window_fmt, inp.compressed_fmt, **launch)
    return out, ring


def own_key_launch(inp, attention_triton, OwnKey, early, **launch):
    """(out, ring) of the one launch."""
    ring = inp.ring.clone()
    out = torch.full_like(inp.q, math.nan)
    own = OwnKey(inp.weight, inp.eps, inp.rot, inp.quantize, inp.slots, early)
    attention_triton(out, inp.q, ring[:inp.q.shape[0]], inp.kv, inp.widx, inp.compressed, inp.cidx, inp.sink,
                     inp.positions, inp.inv_freq, inp.scale, inp.window_fmt, inp.compressed_fmt, own_key=own, **launch)
    return out, ring


def compare_case(spec, device="cpu") -> dict:
    from dsflash_compile.custom_ops.attention_triton import OwnKey, attention_triton
    from dsflash_compile.custom_ops.kv_norm_rope_triton import kv_norm_rope_triton

    spec = dict(spec)
    splits, early = spec.pop("num_splits"), spec.pop("early")
    inp = decode_inputs(device=device, **spec)
    ref_out, ref_ring = torch.full_like(inp.q, math.nan), inp.ring.clone()
    attention_own_key_reference(ref_out, ref_ring, *op_args(inp)[1:])
    two_out, two_ring = two_launches(inp, attention_triton, kv_norm_rope_triton, num_splits=splits)
    out, ring = own_key_launch(inp, attention_triton, OwnKey, early, num_splits=splits)
    written = torch.zeros(ring.shape[:2], dtype=torch.bool, device=ring.device)
    rows = (inp.slots[:, 0] >= 0).nonzero()[:, 0]
    written[rows, inp.slots[rows, 0]] = True
    return dict(same_out=torch.equal(out, two_out), same_ring=torch.equal(ring, two_ring),
                others_kept=torch.equal(ring[~written], inp.ring[~written]), writes=int(written.sum()),
                ring_changed=not torch.equal(ring[written], inp.ring[written]),
                finite=bool(out.isfinite().all()), padding_zero=bool((out[0] == 0).all()),
                max_err=(out.float() - ref_out.float()).abs().max().item(), tol=interpreter_tolerance(ref_out),
                ref_ring_others=torch.equal(ref_ring[~written], inp.ring[~written]))


def interpreter_checks():
    """Entry point of the subprocess (TRITON_INTERPRET=1): one JSON line per case."""
    report_each(CASES, lambda name, spec: compare_case(spec))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_attention_own_key", "interpreter_checks")


def check_case(result):
    assert "error" not in result, result["error"]
    assert result["same_out"] and result["same_ring"], result  # the bits of the two launches it replaces
    assert result["others_kept"] and result["ref_ring_others"] and result["writes"] >= 2, result
    assert result["ring_changed"], result  # the written slots hold the new keys
    assert result["finite"] and result["padding_zero"], result
    assert result["max_err"] <= result["tol"], result  # and the reference's outputs, as attention_'s kernel


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_one_launch_gives_the_two_launches_bits_interpreted(interpreted, name):
    check_case(interpreted[name])


@requires_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_one_launch_gives_the_two_launches_bits_cuda(name):
    check_case(dict(name=name, **compare_case(CASES[name], device="cuda")))


@requires_cuda
@pytest.mark.parametrize("early", [False, True])
def test_release_decode_shape_in_a_cuda_graph(early):
    """The release's decode shape (64 heads x 512, 128-slot fp8 ring, 512 NVFP4 compressed rows, the key projection
    the last 512 of 1792 columns) through the op, replayed from a CUDA graph with new inputs: the bits of the two ops
    it replaces."""
    inp = decode_inputs(11, batch=2, heads=64, dim=512, window=128, n_comp=2048, k=512, pairs=32, width=1792,
                        lengths=[0, 3000], device="cuda")
    static = SimpleNamespace(**vars(inp))
    static.ring = inp.ring.clone()
    out = torch.empty_like(inp.q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.attention_own_key_(out, *op_args(static), early=early)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.attention_own_key_(out, *op_args(static), early=early)
    new = decode_inputs(12, batch=2, heads=64, dim=512, window=128, n_comp=2048, k=512, pairs=32, width=1792,
                        lengths=[0, 3001], device="cuda")
    for name, value in vars(new).items():  # every input anew, the ring and the weights too
        if isinstance(value, torch.Tensor):
            getattr(static, name).copy_(value)
    graph.replay()
    want_ring = new.ring.clone()
    key = ops.kv_norm_rope_write_(want_ring, new.slots, "fp8", new.kv, new.weight, EPS, new.rot, True)
    want = torch.empty_like(new.q)
    ops.attention_(want, new.q, want_ring[:2], key, new.widx, new.compressed, new.cidx, new.sink, new.positions,
                   new.inv_freq, new.scale, "fp8", "nvfp4")
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(static.ring, want_ring)


def test_reference_is_the_two_ops_and_opcheck():
    """The reference is kv_norm_rope_write_ then attention_ on its key row; opcheck (schema with out and ring
    mutated, fake kernel, AOT dispatch)."""
    inp = decode_inputs(21)
    out, ring = torch.full_like(inp.q, math.nan), inp.ring.clone()
    ops.attention_own_key_(out, ring, *op_args(inp)[1:])
    want_ring = inp.ring.clone()
    key = kv_norm_rope_reference(inp.kv, inp.weight, EPS, inp.rot, True)
    record_write_reference(want_ring, key, inp.slots, "fp8")
    want = torch.full_like(inp.q, math.nan)
    attention_reference(want, inp.q, want_ring[:3], key, inp.widx, inp.compressed, inp.cidx, inp.sink, inp.positions,
                        inp.inv_freq, inp.scale, "fp8", "nvfp4")
    assert torch.equal(out, want) and torch.equal(ring, want_ring) and not torch.equal(ring, inp.ring)
    for case in (inp, decode_inputs(22, ratio0=True), decode_inputs(23, window_fmt="bf16", quantize=False)):
        torch.library.opcheck(ops.attention_own_key_.default, (torch.zeros_like(case.q), case.ring.clone(),
                                                                *op_args(case)[1:]))


def test_errors_name_the_problem():
    """A key projection that is not one row a query, and (the launch itself) a step of several tokens."""
    inp = decode_inputs(31)
    with pytest.raises(ValueError, match="one key row a query"):
        ops.attention_own_key_(torch.zeros_like(inp.q), inp.ring, inp.q, inp.kv[:2], *op_args(inp)[3:])
    pytest.importorskip("triton")
    from dsflash_compile.custom_ops.attention_triton import OwnKey, attention_triton

    two = SimpleNamespace(**vars(inp))
    two.q, two.kv = torch.cat([inp.q, inp.q], 1), torch.cat([inp.kv, inp.kv], 1)
    with pytest.raises(ValueError, match="own_key takes one-token steps"):
        own_key_launch(two, attention_triton, OwnKey, False)


@pytest.mark.parametrize("early", [False, True])
def test_release_decode_launch_compiles_for_hopper(early):
    """The release's B1 decode launch with its own key compiles for sm_90 without spills; it stores nothing before
    griddepcontrol.wait, and with EARLY_KEY loads the key projection before it."""
    lines, wait = decode_launch_ptx(OWN_KEY=True, EARLY_KEY=early, PAIRS=32, QUANT=True)
    loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    stores = [i for i, line in enumerate(lines) if "st.global" in line]
    assert min(stores) > wait and (min(loads) < wait) == early


def test_the_models_decode_graphs_take_it_through_inductor(fresh_dynamo, monkeypatch):  # noqa: F811
    """The tiny model through Inductor with attention_own_key and linear_norm (its wq_b taken as TMA-sized, as the
    release's), and compress_token_op (test_compress_token.py: one compile for the two one-token launches): every
    one-row decode graph calls dsflash::attention_own_key_ with early set and no key-row op (kv_norm_rope*), the
    query's norm folds into wq_b in the 4 decode graphs where wq_b is its only reader (not the 3 index layers', whose
    indexer reads it too), each KV source's decode graph calls dsflash::compress_token_ once, and generate() gives the
    eager model's tokens."""
    from torch._inductor.utils import run_and_get_code

    from dsflash_compile.custom_ops import bf16_linear_tma_triton as tma

    monkeypatch.setattr(tma, "MIN_K", 64)
    monkeypatch.setattr(tma, "MIN_BYTES", 0)
    model = tiny_model()
    sources = sum(layer.attn.compressor is not None for layer in model.model.layers)
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, max_new_tokens=3, do_sample=False)
    with graph_caches_off():  # so the passes run (and count) here
        dsflash_compile.compile(model, max_batch=1, max_length=64, batch_buckets=(1,), prefill_buckets=(16,),
                                attention_own_key=True, linear_norm=True, compress_token_op=True)
        got, codes = run_and_get_code(lambda: model.generate(ids, max_new_tokens=3, do_sample=False))
    assert torch.equal(got, want)
    decode = [code for code in codes if "attention_own_key_" in code]
    calls = [line for code in decode for line in code.splitlines()
             if "torch.ops.dsflash.attention_own_key_.default(" in line]
    assert len(decode) == 7 and len(calls) == 7 and all(line.endswith(", True)") for line in calls)  # early
    assert not any("kv_norm_rope" in code or "dsflash.attention_.default" in code for code in decode)
    assert model.compiled_runner.pass_manager.matches["linear_norm"] == 4
    compress = [code.count("torch.ops.dsflash.compress_token_.default(") for code in decode]
    assert sources >= 2 and sorted(compress) == [0] * (7 - sources) + [1] * sources, compress
