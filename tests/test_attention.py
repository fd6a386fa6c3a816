"""dsflash::attention_ (custom_ops/attention.py): the reference against a plain float64 formula, the record
formats against bf16 caches holding the same values, and the Triton kernel (custom_ops/attention_triton.py)
against the reference, under Triton's CPU interpreter (in a subprocess) and on CUDA at the release shapes."""

import math
from types import SimpleNamespace

import pytest
import torch

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.custom_ops import records
from dsflash_compile.custom_ops.attention import attention_reference
from dsflash_compile.rope import inverse_frequencies
from interp import report_each, requires_interpreter, run_interpreted

ops = torch.ops.dsflash
OP_ARGS = ("q", "ring", "chunk_kv", "widx", "compressed", "cidx", "sink", "positions", "inv_freq", "scale",
           "window_fmt", "compressed_fmt")
# |op - exact| on the plain formula's inputs, as a multiple of max|v| (v: every key row value). The op rounds
# each probability to bf16 before PV (relative error <= 2^-8, so <= 2^-8 max|v| on o = sum p v / denom, the
# denominator summing unrounded fp32 probabilities), then o to bf16 (<= 2^-8 |o| <= 2^-8 max|v|). The rope
# tail is rotated after that rounding: a rotation keeps the error's norm over a pair, so each rotated value
# is off by <= sqrt(2) * 2^-7 max|v|, and it is rounded to bf16 once more (<= 2^-8 * sqrt(2) max|v|, since
# |rotated| <= the pair's norm <= sqrt(2) max|v|). Total: 3 sqrt(2) 2^-8 ~ 0.0166 max|v|, plus fp32 noise.
ATOL_PER_VMAX = 3 * math.sqrt(2) * 2**-8


def gen(seed):
    return torch.Generator().manual_seed(seed)


def on_grid(x, fmt, dim):
    """bf16 values that `fmt` records hold exactly (decode(encode(x)))."""
    return x.bfloat16() if fmt == "bf16" else records.decode_reference(records.encode_reference(x, fmt), fmt, dim)


def as_cache(values, fmt):
    """A cache of `fmt` holding `values` (bf16 on the format's grid): a bf16 tensor for "bf16", else records."""
    return values.clone() if fmt == "bf16" else records.encode_reference(values, fmt)


def distinct_picks(g, batch, seq, n, width):
    """[batch, seq, width] int64: per query `width` distinct values of range(n), in random order."""
    return torch.stack([torch.randperm(n, generator=g)[:width] for _ in range(batch * seq)]).view(batch, seq, width)


def make_inputs(seed, *, batch=2, seq=5, heads=4, dim=64, window=16, nw=12, n_comp=24, k=8, rope_half=8,
                window_fmt="bf16", compressed_fmt="bf16", bmax=None, idx_dtype=torch.int64, ratio0=False,
                drop=(0.1, 0.4), special_queries=True, chunk_rows=None):
    """Inputs of attention_ (plus the bf16 values the caches hold: ring_vals, comp_vals). Window entries pick
    ring slots (< window) and rows of this chunk (window + j) alike; rows are ragged (each row b drops its
    own share of entries to -1, from drop[0] to drop[1]); with special_queries, query (0, 0) is left padding
    (every entry -1, position -1), and with seq >= 3 and batch >= 2, query (1, 1) has only window keys and
    query (1, 2) only compressed ones. ratio0: a layer
    without compressed keys, called as the model does (compressed = ring[:, :0], cidx [B, S, 0]). chunk_rows:
    the chunk's keys (default seq; more: the queries are its last columns, as at bounded replay's last KV
    source)."""
    g = gen(seed)
    bmax = bmax or batch + 1  # caches have more batch rows than the call uses
    q = torch.randn(batch, seq, heads, dim, generator=g).bfloat16()
    ring_vals = on_grid(torch.randn(bmax, window, dim, generator=g), window_fmt, dim)
    comp_vals = on_grid(torch.randn(bmax, n_comp, dim, generator=g), compressed_fmt, dim)
    chunk_rows = chunk_rows or seq
    chunk_kv = torch.randn(batch, chunk_rows, dim, generator=g).bfloat16()
    assert nw <= window + chunk_rows and k <= n_comp
    widx = distinct_picks(g, batch, seq, window + chunk_rows, nw)
    cidx = distinct_picks(g, batch, seq, n_comp, k)
    drop = torch.linspace(*drop, batch).view(batch, 1, 1)  # ragged: a different share of -1 per row
    widx = widx.masked_fill(torch.rand(widx.shape, generator=g) < drop, -1)
    cidx = cidx.masked_fill(torch.rand(cidx.shape, generator=g) < drop, -1)
    positions = (torch.arange(batch) * 23 + 40).view(batch, 1) + torch.arange(seq)
    if special_queries:
        widx[0, 0], cidx[0, 0], positions[0, 0] = -1, -1, -1
    if special_queries and seq >= 3 and batch >= 2:
        cidx[1, 1] = -1
        widx[1, 2] = -1
    inv_freq = 1.0 / 10000 ** (torch.arange(rope_half, dtype=torch.float32) / rope_half)
    inp = SimpleNamespace(
        q=q, ring=as_cache(ring_vals, window_fmt), chunk_kv=chunk_kv, widx=widx.to(idx_dtype),
        compressed=as_cache(comp_vals, compressed_fmt), cidx=cidx.to(idx_dtype),
        # [-1, 2] + log(list length / 10): e^sink comparable to the sum of the keys' e^s, so it matters
        sink=torch.rand(heads, generator=g) * 3 - 1 + math.log(max(nw + k, 1) / 10),
        positions=positions, inv_freq=inv_freq, scale=dim ** -0.5, window_fmt=window_fmt,
        compressed_fmt=compressed_fmt, ring_vals=ring_vals, comp_vals=comp_vals)
    if ratio0:
        inp.compressed, inp.comp_vals = inp.ring[:, :0], ring_vals[:, :0]
        inp.cidx, inp.compressed_fmt = inp.cidx[..., :0], window_fmt
    return inp


def op_args(inp, **override):
    return tuple(override.get(name, getattr(inp, name)) for name in OP_ARGS)


def run_op(inp, **override):
    """attention_ into a NaN-filled out (so an unwritten value shows), returning out."""
    out = torch.full_like(inp.q, math.nan)
    assert ops.attention_(out, *op_args(inp, **override)) is None
    return out


def plain_attention(inp, sink=None):
    """float64: o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink_h}), s_j = scale q . k_j over the valid window
    entries (< W: ring slot, >= W: chunk_kv row - W) and compressed rows; then the trailing r dims rotated
    back by the query position: pair (x0, x1) -> (x0 cos a + x1 sin a, x1 cos a - x0 sin a), a = pos * f_i."""
    sink = (inp.sink if sink is None else sink).double()
    batch, seq, heads, dim = inp.q.shape
    window = inp.ring_vals.shape[1]
    r = 2 * inp.inv_freq.shape[0]
    out = torch.zeros(batch, seq, heads, dim, dtype=torch.float64)
    for b in range(batch):
        for t in range(seq):
            w, c = inp.widx[b, t].long(), inp.cidx[b, t].long()
            w = w[w >= 0]
            keys = torch.cat([inp.ring_vals[b, w[w < window]], inp.chunk_kv[b, w[w >= window] - window],
                              inp.comp_vals[b, c[c >= 0]]]).double()
            if len(keys) == 0:
                continue
            s = inp.q[b, t].double() @ keys.T * inp.scale  # [H, K]
            m = torch.maximum(s.amax(-1), sink)
            e = torch.exp(s - m[:, None])
            o = (e @ keys) / (e.sum(-1) + torch.exp(sink - m))[:, None]
            a = inp.positions[b, t].double() * inp.inv_freq.double()
            x0, x1 = o[:, dim - r::2].clone(), o[:, dim - r + 1::2].clone()
            o[:, dim - r::2] = x0 * a.cos() + x1 * a.sin()
            o[:, dim - r + 1::2] = x1 * a.cos() - x0 * a.sin()
            out[b, t] = o
    return out


def plain_atol(inp):
    vmax = max(inp.ring_vals.abs().max(), inp.chunk_kv.abs().max(),
               inp.comp_vals.abs().max() if inp.comp_vals.numel() else 0.0).item()
    return ATOL_PER_VMAX * vmax + 1e-5


# ------------------------------------------------------------------------------- reference (CPU) op


OPCHECK_CASES = {
    "bf16": dict(),
    "bf16-int32": dict(idx_dtype=torch.int32),
    "fp8-nvfp4": dict(window_fmt="fp8", compressed_fmt="nvfp4"),
    "fp8-fp8": dict(window_fmt="fp8", compressed_fmt="fp8"),
    "ratio0-fp8": dict(window_fmt="fp8", ratio0=True),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_attention_opcheck(case):
    """opcheck (schema incl. the mutation of `out`, fake kernel, AOT dispatch) with -1 entries, records, int32
    indices and the ratio-0 shape."""
    inp = make_inputs(0, **OPCHECK_CASES[case])
    assert (inp.widx == -1).any()
    out = torch.zeros_like(inp.q)
    torch.library.opcheck(ops.attention_.default, (out, *op_args(inp)))


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_attention_matches_plain_formula(idx_dtype):
    """out equals the sink-in-denominator softmax over the valid window (ring + chunk) and compressed keys with
    the rope tail rotated back by the query position, within the bf16 rounding bound (ATOL_PER_VMAX)."""
    inp = make_inputs(1, idx_dtype=idx_dtype)
    assert ((inp.widx >= 0) & (inp.widx < 16)).any() and (inp.widx >= 16).any()  # ring and chunk keys
    out = run_op(inp)
    assert out.dtype == torch.bfloat16 and out.shape == inp.q.shape
    expected = plain_attention(inp)
    atol = plain_atol(inp)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    # the sink and the inverse rotation must matter at this tolerance, or the comparison would not test them
    without_sink = plain_attention(inp, sink=torch.full_like(inp.sink, -math.inf))
    assert (without_sink - expected).abs().max() > 5 * atol
    unrotated = plain_attention(SimpleNamespace(**{**vars(inp), "positions": torch.zeros_like(inp.positions)}))
    assert (unrotated - expected).abs().max() > 5 * atol


def test_attention_all_invalid_query_is_zero():
    """A query whose every window and compressed entry is -1 gets exactly zeros; the others are unaffected."""
    inp = make_inputs(3)
    out = run_op(inp)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))  # query (0, 0): padding, nothing valid
    assert out.isfinite().all()
    widx, cidx = inp.widx.clone(), inp.cidx.clone()
    widx[1, 3], cidx[1, 3] = -1, -1
    cut = run_op(inp, widx=widx, cidx=cidx)
    assert torch.equal(cut[1, 3], torch.zeros_like(cut[1, 3]))
    others = torch.ones(out.shape[:2], dtype=torch.bool)
    others[1, 3] = False
    assert torch.equal(cut[others], out[others])


@pytest.mark.parametrize("window_fmt", ["bf16", "fp8"])
def test_attention_ratio0_layer(window_fmt):
    """Ratio-0 shape (compressed with 0 rows, cidx of width 0): the window-only formula; the same as a
    compressed list of -1 entries."""
    inp = make_inputs(4, ratio0=True, window_fmt=window_fmt)
    assert inp.compressed.shape[1] == 0 and inp.cidx.shape[-1] == 0
    out = run_op(inp)
    torch.testing.assert_close(out.double(), plain_attention(inp), atol=plain_atol(inp), rtol=0)
    none_valid = make_inputs(4, window_fmt=window_fmt, compressed_fmt=window_fmt)  # same q, ring, widx
    assert torch.equal(none_valid.widx, inp.widx)
    assert torch.equal(run_op(none_valid, cidx=torch.full_like(none_valid.cidx, -1)), out)


def test_attention_many_keys_online_softmax():
    """More than 64 keys (several online-softmax blocks, the running max rising): still the plain formula."""
    n_comp = 200
    inp = make_inputs(5, batch=2, seq=3, window=48, nw=48, n_comp=n_comp, k=150, drop=(0.05, 0.15),
                      special_queries=False)
    # later compressed rows have larger norms and cidx lists them in ascending order, so the later blocks
    # hold the larger scores and the running max must be rescaled several times
    inp.comp_vals = (inp.comp_vals.float() * torch.linspace(0.5, 3.0, n_comp)[None, :, None]).bfloat16()
    inp.compressed = inp.comp_vals
    cidx = torch.where(inp.cidx >= 0, inp.cidx, n_comp).sort(dim=-1).values
    inp.cidx = cidx.masked_fill(cidx == n_comp, -1)
    valid = (inp.widx >= 0).sum(-1) + (inp.cidx >= 0).sum(-1)
    assert valid.min() > 2 * 64
    out = run_op(inp)
    torch.testing.assert_close(out.double(), plain_attention(inp), atol=plain_atol(inp), rtol=0)


def test_attention_key_source_is_irrelevant():
    """A key list gives the same output (bit for bit) whether its rows come from the ring, from this chunk's
    kv or from the compressed cache, and wherever the list is split between window and compressed entries."""
    inp = make_inputs(6, nw=20, k=0, seq=5, window=16)
    window = inp.ring.shape[1]
    batch = inp.q.shape[0]
    table = torch.cat([inp.ring[:batch], inp.chunk_kv], dim=1)  # row i: ring slot i, or chunk row i - W
    lst = inp.widx  # entries into `table`, exactly the window entries' meaning
    out = run_op(inp, cidx=lst[..., :0])
    everything_compressed = run_op(inp, widx=lst[..., :0], compressed=table, cidx=lst)
    moved = run_op(inp, widx=lst[..., :7], compressed=table, cidx=lst[..., 7:])
    assert torch.equal(everything_compressed, out)
    assert torch.equal(moved, out)
    # the chunk rows copied into the ring (slots W..W+S of a wider ring) instead of read from chunk_kv
    wide_ring = torch.cat([inp.ring, torch.zeros(1, inp.chunk_kv.shape[1], inp.chunk_kv.shape[2]).bfloat16()
                           .expand(inp.ring.shape[0], -1, -1)], dim=1).clone()
    wide_ring[:batch, window:] = inp.chunk_kv
    from_ring = run_op(inp, ring=wide_ring, cidx=lst[..., :0], chunk_kv=torch.full_like(inp.chunk_kv, math.nan))
    assert torch.equal(from_ring, out)


@pytest.mark.parametrize("window_fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("compressed_fmt", ["bf16", "fp8", "nvfp4"])
def test_attention_record_formats(window_fmt, compressed_fmt):
    """Ring / compressed records holding values on their format's grid give bit for bit the output of bf16
    caches holding those values (the reference decodes, then computes)."""
    inp = make_inputs(7, window_fmt=window_fmt, compressed_fmt=compressed_fmt, n_comp=32, k=12)
    for cache, vals, fmt in ((inp.ring, inp.ring_vals, window_fmt), (inp.compressed, inp.comp_vals, compressed_fmt)):
        assert cache.dtype == (torch.bfloat16 if fmt == "bf16" else torch.uint8)
        if fmt != "bf16":
            assert cache.shape[-1] == records.record_bytes(fmt, 64)
            assert torch.equal(records.decode_reference(cache, fmt, 64), vals)  # the records hold the values
    out = run_op(inp)
    as_bf16 = run_op(inp, ring=inp.ring_vals, compressed=inp.comp_vals, window_fmt="bf16", compressed_fmt="bf16")
    assert torch.equal(out, as_bf16)
    torch.testing.assert_close(out.double(), plain_attention(inp), atol=plain_atol(inp), rtol=0)


# ------------------------------------------------------------------- Triton kernel, CPU interpreter


def interpreter_cases():
    """name -> make_inputs kwargs + num_splits (+ block_n). Every format pair x num_splits 1 / 3 / None, heads
    20 (head group 32: 12 masked rows) or 4 (head group 16, the smallest tl.dot), windows of 16 or 32 slots, up
    to 40 compressed entries; the ratio-0 shape; 64-key blocks (what many tokens get on the GPU). With
    num_splits None on the interpreter (8 "SMs"), splits = min(blocks, 8 // (tokens * head groups)): the
    decode-shaped cases (3 rows x 1 token, 4 heads) get 2 splits."""
    cases = {}
    i = 0
    for window_fmt in ("bf16", "fp8"):
        for compressed_fmt in ("bf16", "fp8", "nvfp4"):
            for splits in (1, 3, None):
                heads = 20 if i % 2 == 0 else 4
                window = 32 if i % 3 == 0 else 16
                shape = dict(batch=3, seq=1, heads=4) if splits is None else dict(batch=2, seq=5, heads=heads)
                cases[f"{window_fmt}-{compressed_fmt}-split{splits}-h{shape['heads']}-w{window}"] = dict(
                    window_fmt=window_fmt, compressed_fmt=compressed_fmt, window=window, nw=window,
                    n_comp=48, k=40 if i % 3 == 0 else 24, num_splits=splits, seed=100 + i, **shape)
                i += 1
    for splits in (1, None):
        cases[f"ratio0-fp8-split{splits}"] = dict(window_fmt="fp8", ratio0=True, window=32, nw=32, num_splits=splits,
                                                  seed=200, **(dict(batch=3, seq=1) if splits is None else {}))
    # a window list wider than the ring (20 entries: ring slots and chunk rows), not a multiple of the block
    cases["wide-window-list-h20"] = dict(window_fmt="fp8", compressed_fmt="nvfp4", heads=20, seq=6, window=16,
                                         nw=20, seed=300)
    # 64-key blocks: a partly filled window block, then compressed blocks split across programs
    cases["block64-fp8-nvfp4-split2"] = dict(window_fmt="fp8", compressed_fmt="nvfp4", batch=3, seq=1, window=32,
                                             nw=32, n_comp=160, k=150, num_splits=2, block_n=64, seed=400)
    # queries at the last 3 of 11 chunk columns: each row reads its own chunk's keys (row 1 starts 11 rows in)
    cases["last-queries-of-a-longer-chunk"] = dict(window_fmt="fp8", compressed_fmt="nvfp4", batch=2, seq=3,
                                                   chunk_rows=11, window=16, nw=24, seed=500)
    # the merge with several heads a program (3 splits: one padded split slot) and with 4 of 20 heads
    cases["merge-4-heads-split3"] = dict(window_fmt="fp8", compressed_fmt="nvfp4", batch=3, seq=1, heads=4,
                                         window=16, nw=16, n_comp=48, k=40, num_splits=3, heads_per_merge=4, seed=600)
    cases["merge-4-of-20-heads-split2"] = dict(window_fmt="fp8", compressed_fmt="fp8", batch=2, seq=2, heads=20,
                                               window=32, nw=32, n_comp=48, k=24, num_splits=2, heads_per_merge=4,
                                               seed=601)
    return cases


def interpreter_tolerance(ref):
    """2^-6 max|o|: at least 2 bf16 ulps of max|o| (at most 4). Kernel and reference round the same fp32 math at
    different points, each up to about 1 ulp from the exact value: probabilities to bf16 against running
    maxima of blocks of 32 vs 64 keys, the output once (kernel, rotated in fp32) vs before and after the
    inverse rotation (reference). The interpreter's fp32 -> bf16 cast also truncates instead of rounding to
    nearest, so there the kernel is biased towards zero by up to about 1 more ulp. Measured on these cases:
    1 ulp of max|o| in most, 2 ulps (0.0156 at max|o| 1.73) in some; a bug (no sink, no rotation, a wrong
    dequantization) is off by a good fraction of |o|."""
    return 2**-6 * ref.float().abs().max().item()


def run_interpreter_case(name, spec):
    """(runs with TRITON_INTERPRET=1) kernel vs reference for one case; returns a dict of measurements."""
    from dsflash_compile.custom_ops.attention_triton import attention_triton

    spec = dict(spec)
    splits, block_n, seed = spec.pop("num_splits", 1), spec.pop("block_n", None), spec.pop("seed")
    per_merge = spec.pop("heads_per_merge", None)
    inp = make_inputs(seed, **spec)
    batch = inp.q.shape[0]
    args = op_args(inp, ring=inp.ring[:batch], compressed=inp.compressed[:batch])
    ref = torch.full_like(inp.q, math.nan)
    attention_reference(ref, *args)
    out = torch.full_like(inp.q, math.nan)
    attention_triton(out, *args, num_splits=splits, block_n=block_n, heads_per_merge=per_merge)
    tol = interpreter_tolerance(ref)
    err = (out.float() - ref.float()).abs()
    no_sink = torch.full_like(inp.q, math.nan)
    attention_reference(no_sink, *op_args(inp, sink=torch.full_like(inp.sink, -math.inf)))
    window = inp.ring.shape[1]
    return dict(
        name=name, max_err=err.max().item(), tol=tol, finite=bool(out.isfinite().all()),
        padding_zero=bool((out[0, 0] == 0).all()),
        ring_and_chunk=bool(((inp.widx >= 0) & (inp.widx < window)).any() and (inp.widx >= window).any()),
        sink_effect=(no_sink.float() - ref.float()).nan_to_num(0.0).abs().max().item())  # (0, 0): 0 / 0 without sink


def interpreter_checks():
    """Entry point of the subprocess: one JSON line per case."""
    import triton

    assert triton.knobs.runtime.interpret, "TRITON_INTERPRET=1 must be set before triton is imported"
    report_each(interpreter_cases(), run_interpreter_case)


@pytest.fixture(scope="module")
def interpreted():
    """Every interpreter case, run in one subprocess with TRITON_INTERPRET=1 (see interp.py)."""
    return run_interpreted("test_attention", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(interpreter_cases()))
def test_triton_matches_reference_interpreted(interpreted, name):
    """The Triton kernel under the CPU interpreter vs the reference: within 2^-6 max|o| (~2 bf16 ulps of the
    output scale, interpreter_tolerance); a query with nothing valid gets exact zeros; every value written and
    finite."""
    result = interpreted[name]
    assert "error" not in result, result["error"]
    assert result["finite"] and result["padding_zero"], result
    assert result["max_err"] <= result["tol"], result
    assert result["ring_and_chunk"], result  # window entries from the ring and from this chunk's kv
    assert result["sink_effect"] > 5 * result["tol"], result  # the tolerance sees a missing sink


# ------------------------------------------------------------------------------- Triton kernel, CUDA


def release_inputs(seed, batch, seq, compressed_fmt, pad=(), lengths=None, n_comp=2048, ratio=4):
    """Release shapes: 64 heads x 512 (rope 64), a 128-slot fp8 ring, 512 compressed entries. Window entries
    follow context.build_context's rule (ring slot pos % W for keys before this chunk, W + chunk row for the
    chunk's own, left padding `pad[b]` tokens with position -1); compressed entries are distinct rows below
    the query's visible count (pos + 1) // ratio, -1 past it."""
    g = gen(seed)
    heads, dim, window, k = 64, 512, 128, 512
    bmax = batch + 1
    lengths = torch.tensor(lengths) if lengths is not None else torch.randint(600, 8000, (batch,), generator=g)
    pad = torch.tensor(pad or [0] * batch)
    t = torch.arange(seq)
    real = t >= pad.view(batch, 1)
    positions = torch.where(real, lengths.view(batch, 1) + t - pad.view(batch, 1), -1)
    start = (positions - window + 1).clamp_min(0).unsqueeze(-1)
    key_pos = start + torch.arange(window)
    in_ring = key_pos < lengths.view(batch, 1, 1)
    idx = torch.where(in_ring, key_pos % window, window + key_pos - lengths.view(batch, 1, 1) + pad.view(batch, 1, 1))
    widx = torch.where((key_pos <= positions.unsqueeze(-1)) & (positions.unsqueeze(-1) >= 0), idx, -1)
    visible = torch.where(positions >= 0, (positions + 1) // ratio, 0).clamp_max(n_comp)
    scores = torch.rand(batch, seq, n_comp, generator=g).masked_fill(torch.arange(n_comp) >= visible.unsqueeze(-1), -1)
    top = scores.topk(k, dim=-1)
    cidx = torch.where(top.values >= 0, top.indices, -1).sort(dim=-1).values  # -1 first, as a sort leaves it
    ring_vals = torch.randn(bmax, window, dim, generator=g)
    comp_vals = torch.randn(bmax, n_comp, dim, generator=g)
    return SimpleNamespace(
        q=torch.randn(batch, seq, heads, dim, generator=g).bfloat16(),
        ring=records.encode_reference(ring_vals, "fp8")[:batch],
        chunk_kv=torch.randn(batch, seq, dim, generator=g).bfloat16(),
        widx=widx, compressed=records.encode_reference(comp_vals, compressed_fmt)[:batch], cidx=cidx,
        sink=torch.rand(heads, generator=g) * 3 - 1, positions=positions, inv_freq=inverse_frequencies(64, 10000.0),
        scale=dim ** -0.5, window_fmt="fp8", compressed_fmt=compressed_fmt)


CUDA_SHAPES = {
    "decode-b1": dict(batch=1, seq=1),
    "decode-b8": dict(batch=8, seq=1),
    "prefill-ragged-2x200": dict(batch=2, seq=200, pad=(60, 0), lengths=(0, 3000)),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compressed_fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("shape", list(CUDA_SHAPES))
def test_triton_cuda_matches_reference_release_shapes(shape, compressed_fmt):
    """On CUDA the op runs the Triton kernel: within 2e-2 max|o| of the reference (run on the same device),
    at the release shapes; padding queries get exact zeros. (Measured on an H200: <= 5.5e-3 max|o|, 1 ulp.)"""
    pytest.importorskip("triton")
    inp = release_inputs(1, compressed_fmt=compressed_fmt, **CUDA_SHAPES[shape])
    for name in OP_ARGS:
        if isinstance(getattr(inp, name), torch.Tensor):
            setattr(inp, name, getattr(inp, name).cuda())
    ref = torch.full_like(inp.q, math.nan)
    attention_reference(ref, *op_args(inp))
    out = run_op(inp)  # dispatches to attention_triton on CUDA
    torch.cuda.synchronize()
    assert out.isfinite().all()
    padding = inp.positions < 0
    if padding.any():
        assert (out[padding] == 0).all()
    scale = ref.float().abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2e-2 * scale, (err, scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(interpreter_cases()))
def test_triton_cuda_matches_reference_small_cases(name):
    """The interpreter's cases compiled for the GPU (bf16 tensor-core dots, round-to-nearest casts): within
    2^-7 max|o| (at least 1 bf16 ulp of max|o|; measured on an H200: <= 1 ulp in every case)."""
    pytest.importorskip("triton")
    spec = dict(interpreter_cases()[name])
    splits, block_n, seed = spec.pop("num_splits", 1), spec.pop("block_n", None), spec.pop("seed")
    per_merge = spec.pop("heads_per_merge", None)
    inp = make_inputs(seed, **spec)
    for arg in OP_ARGS:
        if isinstance(getattr(inp, arg), torch.Tensor):
            setattr(inp, arg, getattr(inp, arg).cuda())
    from dsflash_compile.custom_ops.attention_triton import attention_triton

    ref = torch.full_like(inp.q, math.nan)
    attention_reference(ref, *op_args(inp))
    out = torch.full_like(inp.q, math.nan)
    attention_triton(out, *op_args(inp), num_splits=splits, block_n=block_n, heads_per_merge=per_merge)
    assert out.isfinite().all() and (out[0, 0] == 0).all()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2**-7 * ref.float().abs().max().item(), (err, ref.float().abs().max().item())


def test_merge_heads_choice(monkeypatch):
    """Heads per merge program: powers of two dividing the heads, up to 16, keeping 4 programs per SM (132 on
    an H200: decode batch 64 gets 4 of 64 heads a program, batch 1 one)."""
    from dsflash_compile.custom_ops import attention_triton as kernels

    monkeypatch.setattr(kernels, "_num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert kernels.merge_heads(1, 64, cpu) == 1
    assert kernels.merge_heads(64, 64, cpu) == 4
    assert kernels.merge_heads(1024, 64, cpu) == 16
    assert kernels.merge_heads(1024, 20, cpu) == 4  # 8 does not divide 20
    assert kernels.merge_heads(1024, 5, cpu) == 1


@pytest.mark.parametrize("per_merge", [3, 8])
def test_heads_per_merge_must_divide_the_heads(per_merge):
    """A merge launch that would drop or repeat heads is refused by name (20 heads: 3 is no power of two, 8 does
    not divide 20)."""
    pytest.importorskip("triton")
    from dsflash_compile.custom_ops.attention_triton import attention_triton

    inp = make_inputs(7, window_fmt="fp8", compressed_fmt="fp8", batch=2, seq=1, heads=20, window=16, nw=16,
                      n_comp=32, k=16)
    with pytest.raises(ValueError, match="heads_per_merge"):
        attention_triton(torch.empty_like(inp.q), *op_args(inp), num_splits=2, heads_per_merge=per_merge)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_merge_heads_same_bits_cuda():
    """At the decode batch-64 release shape (2 key splits) every heads-per-merge launch gives the bits of one
    head a program (two partials add in either order to the same value)."""
    pytest.importorskip("triton")
    from dsflash_compile.custom_ops.attention_triton import attention_triton

    inp = release_inputs(3, batch=64, seq=1, compressed_fmt="nvfp4")
    args = [getattr(inp, name).cuda() if isinstance(getattr(inp, name), torch.Tensor) else getattr(inp, name)
            for name in OP_ARGS]
    outs = {}
    for per_merge in (1, 4, 16):
        outs[per_merge] = torch.full_like(args[0], math.nan)
        attention_triton(outs[per_merge], *args, heads_per_merge=per_merge)
    assert outs[1].isfinite().all()
    assert torch.equal(outs[4], outs[1]) and torch.equal(outs[16], outs[1])


ATTENTION_SPEC_ARGS = dict(q_ptr="*bf16", ring_ptr="*u8", chunk_ptr="*bf16", widx_ptr="*i32", comp_ptr="*u8",
                           cidx_ptr="*i32", sink_ptr="*fp32", pos_ptr="*i64", freq_ptr="*fp32", out_ptr="*bf16",
                           part_acc_ptr="*fp32", part_ml_ptr="*fp32", S="i32", K="i32", chunk_sb="i32",
                           ring_sb="i32", ring_sr="i32", comp_sb="i32", comp_sr="i32", scale="fp32",
                           blocks_per_split="i32", comp_rows="i32", ring_bytes="i32", comp_bytes="i32",
                           key_w_ptr="*bf16", rot_ptr="*fp32", slots_ptr="*i64", eps="fp32", slots_sb="i32")


def decode_launch_ptx(**constexprs) -> tuple[list[str], int]:
    """The release's B1 decode launch (16 heads a program, 32-key blocks, fp8 window and NVFP4 compressed records,
    split; `constexprs` override) compiled for sm_90, checked for spills: its PTX lines and griddepcontrol.wait's."""
    from hopper import check_compiles_for_hopper, compile_for_hopper

    from dsflash_compile.custom_ops import attention_triton as kernels

    constexprs = dict(dict(H=64, D=512, W=128, NW=128, HALF_ROPE=32, HG=kernels.ONE_TOKEN_HEAD_GROUP,
                           BLOCK_N=kernels.SMALL_BLOCK_N, WIN_FMT=1, CMP_FMT=2, SPLIT=True, INTERPRET=False,
                           PREFETCH=False, OWN_KEY=False, EARLY_KEY=False, PAIRS=1, QUANT=False), **constexprs)
    spec = ("_attention_kernel", ATTENTION_SPEC_ARGS, constexprs, kernels.NUM_WARPS, kernels.NUM_STAGES)
    check_compiles_for_hopper(kernels, spec)
    lines = compile_for_hopper(kernels, spec).asm["ptx"].splitlines()
    return lines, next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)


@pytest.mark.parametrize("prefetch", [False, True])
def test_decode_launch_compiles_for_hopper_without_spills(prefetch):
    """The release's B1 decode launch without spills on sm_90; with PREFETCH the first block's records are asked of
    L2 (cp.async.bulk.prefetch.L2) before griddepcontrol.wait, and nothing is stored before it."""
    lines, wait = decode_launch_ptx(PREFETCH=prefetch)
    prefetches = [i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2" in line]
    stores = [i for i, line in enumerate(lines) if "st.global" in line]
    assert bool(prefetches) == prefetch and all(i < wait for i in prefetches) and min(stores) > wait


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compressed_fmt", ["nvfp4", "fp8"])
def test_prefetch_keeps_the_outputs_cuda(compressed_fmt):
    """The decode launch with its key records asked of L2 before the wait (PREFETCH_KEYS) gives the same bits,
    eager and after a stale top-k list (the prefetch reads it before the wait: a hint at most)."""
    from dsflash_compile.custom_ops.attention_triton import attention_triton

    inp = release_inputs(1, compressed_fmt=compressed_fmt, batch=1, seq=1)
    for name in OP_ARGS:
        if isinstance(getattr(inp, name), torch.Tensor):
            setattr(inp, name, getattr(inp, name).cuda())
    outs = {}
    for prefetch in (False, True):
        outs[prefetch] = torch.empty_like(inp.q)
        attention_triton(outs[prefetch], *op_args(inp), prefetch=prefetch)
    assert torch.equal(outs[True], outs[False])
    inp.cidx.copy_(inp.cidx.flip(-1))  # another list, then the launch: the same bits as without the hint
    again = {p: torch.empty_like(inp.q) for p in (False, True)}
    for prefetch, out in again.items():
        attention_triton(out, *op_args(inp), prefetch=prefetch)
    assert torch.equal(again[True], again[False])
