"""dsflash::compress_token_ (custom_ops/compress_token.py): a KV source's compressor after its projection, in a
one-token step, as one launch.

The reference is the model's compressor path (the tiny model's logits are the same bits with the op as without);
the Triton launch (compress_token_triton) gives the reference's records bit for bit where the math is exact in any
order (equal scores pool as halves, one-hot key weights) under the interpreter (on CUDA, with the GPU's own rsqrt and
exp, within a bf16 ulp before the FP4 rounding), and its pending state always; with random scores and key weights
its rows are the reference's within bf16 rounding; rows whose row id is
negative (a group still open, a padding row, a row below the write floor) write no record and leave every other row
as it was; a CUDA graph replays it with new inputs; it compiles for sm_90 without spills; opcheck and errors. The
tiny model's decode graphs through Inductor take it: test_attention_own_key.py (one compile for both one-token
launches)."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report_each, requires_interpreter, run_interpreted
from test_attention import gen
from test_compile import tiny_model

from dsflash_compile.context import ForwardContext
from dsflash_compile.custom_ops import records
from dsflash_compile.custom_ops.compress_token import compress_token_reference
from dsflash_compile.rope import rotation

ops = torch.ops.dsflash
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
EPS = 1e-6
CACHE_ARGS = ("compressed", "index_keys", "pending_kv", "pending_score")
OP_ARGS = CACHE_ARGS + ("kv", "score", "source", "complete", "row_ids", "rot", "weight", "eps", "key_weight",
                        "key_norm_weight", "key_eps", "quantize", "compressed_fmt", "index_fmt")


def step_inputs(seed, *, ratio=2, dim=64, key_dim=32, pairs=8, rows=24, keys=True, quantize=True,
                compressed_fmt="nvfp4", index_fmt="mxfp4", equal_scores=False, one_hot=False, device="cpu"):
    """One decode step of a KV source as the model lays it out (context.ForwardContext.group_rows): row 0 pads (no
    token), row 4 lies below the write floor (its group closes, no record), rows 1, 3 and 5 close their group, row 2
    leaves it open (ratio > 1); the projections are column slices of a wider one (the fused wkv + wgate);
    caches hold random bytes, so a record written where none should be shows. equal_scores: every slot of a group
    scores the same (its pooling is exact halves); one_hot: each key is one latent value times a power of two (the
    keys' projection is exact)."""
    g = gen(seed)
    lengths = torch.tensor([0, ratio - 1, ratio, 3 * ratio - 1, 4 * ratio - 1, 8 * ratio + ratio - 1])
    batch, bmax = len(lengths), len(lengths) + 1
    positions = torch.where(torch.arange(batch) == 0, -1, lengths).view(batch, 1)
    inv_freq = 1.0 / 10000 ** (torch.arange(pairs, dtype=torch.float32) / pairs)
    ctx = ForwardContext(cache=None, positions=positions, lengths_before=lengths, window_idx=None, window_slots=None,
                         columns_after=0, inv_freq={"compressed": inv_freq},
                         rotations={"compressed": rotation(positions.clamp_min(0), inv_freq)},
                         write_floor=torch.where(torch.arange(batch) == 4, lengths + 1, 0))
    group = ctx.group_rows(ratio)
    inp = dict(source=group.source, complete=group.complete, row_ids=group.row_ids, rot=group.rot, eps=EPS,
               key_eps=EPS, quantize=quantize, compressed_fmt=compressed_fmt, index_fmt=index_fmt)
    if ratio > 1:
        wide = torch.randn(batch, 1, 3 * dim, generator=g)
        kv, score = wide[..., :dim], wide[..., dim:2 * dim]
        pending_kv, pending_score = torch.zeros(bmax, ratio, dim), torch.full((bmax, ratio), -torch.inf)
        pending_score = pending_score.unsqueeze(-1).expand(-1, -1, dim).clone()
        for b in range(batch):  # the open group's cached slots, as earlier steps left them
            cached = int(lengths[b]) % ratio
            pending_kv[b, :cached] = torch.randn(cached, dim, generator=g)
            pending_score[b, :cached] = score[b, 0] if equal_scores else torch.randn(cached, dim, generator=g)
        pending_score[batch] = 3.0  # a row past the batch: never read or written
        inp.update(kv=kv, score=score, pending_kv=pending_kv, pending_score=pending_score)
    else:
        inp.update(kv=torch.randn(batch, 1, 2 * dim, generator=g).bfloat16()[..., dim:], score=None, pending_kv=None,
                   pending_score=None)
    inp["weight"] = (torch.rand(dim, generator=g) + 0.5).bfloat16()
    comp_bytes = records.record_bytes(compressed_fmt, dim)
    inp["compressed"] = (torch.randn(bmax, rows, dim, generator=g).bfloat16() if compressed_fmt == "bf16"
                         else torch.randint(0, 256, (bmax, rows, comp_bytes), generator=g, dtype=torch.uint8))
    if keys:
        if one_hot:
            pick = torch.randperm(dim, generator=g)[:key_dim]
            scale = 2.0 ** torch.randint(-2, 3, (key_dim,), generator=g) * (torch.randint(0, 2, (key_dim,),
                                                                                           generator=g) * 2 - 1)
            key_weight = torch.zeros(key_dim, dim).index_put_((torch.arange(key_dim), pick), scale)
        else:
            key_weight = torch.randn(key_dim, dim, generator=g) * dim ** -0.5
        key_bytes = records.record_bytes(index_fmt, key_dim)
        inp.update(key_weight=key_weight.bfloat16(),
                   key_norm_weight=(torch.rand(key_dim, generator=g) + 0.5).bfloat16(),
                   index_keys=(torch.randn(bmax, rows, key_dim, generator=g).bfloat16() if index_fmt == "bf16"
                               else torch.randint(0, 256, (bmax, rows, key_bytes), generator=g, dtype=torch.uint8)))
    else:
        inp.update(key_weight=None, key_norm_weight=None, index_keys=None)
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in inp.items()}


def args_of(inp, fresh=True):
    """The op's arguments in order, its caches cloned (fresh) so each run writes its own."""
    return tuple(inp[name].clone() if fresh and name in CACHE_ARGS and inp[name] is not None else inp[name]
                 for name in OP_ARGS)


def record_errors(got, want, fmt, width) -> tuple[float, float]:
    """(largest |difference| beyond its allowance, share of values that differ) of written records, decoded. The
    allowance: a bf16 row's 2 ulps of its largest value; a quantized group's one E2M1 step at the top of its grid
    (amax / 3), what a one-ulp difference before the FP4 rounding (the GPU's rsqrt, exp, summation order) can move a
    code by."""
    a, b = (c.float() if fmt == "bf16" else records.decode_reference(c, fmt, width, torch.float32) for c in (got, want))
    if fmt == "bf16":
        allowed = 2 ** -7 * b.abs().amax(-1, keepdim=True)
    else:
        groups = b.unflatten(-1, (-1, records._BLOCK[fmt]))
        allowed = (groups.abs().amax(-1, keepdim=True) / 3).expand_as(groups).flatten(-2)
    diff = (a - b).abs()
    return (diff - allowed).max().item(), (diff > 0).float().mean().item()


CASES = {  # step_inputs kwargs + exact: records compared bit for bit (else within bf16 rounding)
    "ratio2-nvfp4-mxfp4-exact": dict(equal_scores=True, one_hot=True, exact=True, seed=1),
    "ratio1-nvfp4-mxfp4-exact": dict(ratio=1, one_hot=True, exact=True, seed=2),
    "ratio2-no-keys-exact": dict(keys=False, equal_scores=True, exact=True, seed=3),
    "ratio4-bf16-unquantized": dict(ratio=4, compressed_fmt="bf16", index_fmt="bf16", quantize=False, exact=False,
                                    seed=4),
    "ratio2-bf16-unquantized": dict(compressed_fmt="bf16", index_fmt="bf16", quantize=False, exact=False, seed=5),
    "ratio1-128-keys-64-pairs": dict(ratio=1, dim=256, key_dim=128, pairs=32, compressed_fmt="bf16",
                                     index_fmt="bf16", quantize=False, exact=False, seed=6),
}


def compare_case(spec, device="cpu") -> dict:
    from dsflash_compile.custom_ops.compress_token_triton import compress_token_triton

    spec = dict(spec)
    result = dict(exact=spec.pop("exact"))
    inp = step_inputs(device=device, **spec)
    want, got = args_of(inp), args_of(inp)
    compress_token_reference(*want)
    compress_token_triton(*got)
    written = inp["row_ids"][:, 0] >= 0
    rows = inp["row_ids"][written, 0]
    batch = len(written)
    result.update(writes=int(written.sum()), batch=batch)
    dim = inp["kv"].shape[-1]
    for i, (name, fmt) in enumerate((("compressed", inp["compressed_fmt"]), ("index_keys", inp["index_fmt"]))):
        if want[i] is None:
            continue
        mask = torch.zeros(want[i].shape[:2], dtype=torch.bool, device=want[i].device)
        mask[written.nonzero()[:, 0], rows] = True
        width = dim if name == "compressed" else inp["key_weight"].shape[0]
        result[name] = dict(others_kept=torch.equal(got[i][~mask], inp[name][~mask]),
                            changed=not torch.equal(want[i][mask], inp[name][mask]), same=torch.equal(got[i], want[i]),
                            quantized=fmt != "bf16")
        result[name]["excess"], result[name]["differ"] = record_errors(got[i][mask], want[i][mask], fmt, width)
    if inp["score"] is not None:
        result["pending_same"] = torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
        result["pending_changed"] = not torch.equal(want[2][:batch], inp["pending_kv"][:batch])
    return result


def interpreter_checks():
    """Entry point of the subprocess (TRITON_INTERPRET=1): one JSON line per case."""
    report_each(CASES, lambda name, spec: compare_case(spec))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_compress_token", "interpreter_checks")


def check_case(result, bitwise):
    """bitwise (the interpreter, IEEE arithmetic): the exact cases' records are the reference's bits; else (the GPU's
    own rsqrt, exp and FMAs) within record_errors' allowance, few quantized values moved."""
    assert "error" not in result, result["error"]
    assert result["writes"] >= 2 and result["writes"] < result["batch"] - 1, result  # rows with and without one
    for name in ("compressed", "index_keys"):
        if name in result:
            records_of = result[name]
            assert records_of["others_kept"] and records_of["changed"], result
            assert records_of["same"] if bitwise and result["exact"] else records_of["excess"] <= 0, result
            assert not records_of["quantized"] or records_of["differ"] <= 0.05, result
    if "pending_same" in result:
        assert result["pending_same"] and result["pending_changed"], result


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_gives_the_reference_interpreted(interpreted, name):
    check_case(interpreted[name], bitwise=True)


@requires_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_gives_the_reference_cuda(name):
    check_case(compare_case(CASES[name], device="cuda"), bitwise=False)


@requires_cuda
@pytest.mark.parametrize("ratio", [2, 1])
def test_release_decode_shape_in_a_cuda_graph(ratio):
    """The release's shapes (rows of 512, keys of 128, 32 rotated pairs, NVFP4 / MXFP4 records) through the op,
    replayed from a CUDA graph with new inputs: the records and pending state of the op run eagerly on them."""
    shape = dict(ratio=ratio, dim=512, key_dim=128, pairs=32, rows=64, device="cuda")
    static = step_inputs(11, **shape)
    args = args_of(static, fresh=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.compress_token_(*args_of(static))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.compress_token_(*args)
    new = step_inputs(12, **shape)
    want = args_of(new)
    for name, value in new.items():  # every input anew, caches and weights too
        if isinstance(value, torch.Tensor):
            static[name].copy_(value)
    graph.replay()
    ops.compress_token_(*want)
    torch.cuda.synchronize()
    for i, name in enumerate(CACHE_ARGS):
        assert want[i] is None or torch.equal(static[name], want[i]), name


def test_reference_is_the_models_compressor_and_opcheck(monkeypatch):
    """The tiny model's eager decode with its KV sources' one-token steps through the op gives the logits of its own
    compressor path, bit for bit; opcheck (schema with the caches mutated, fake kernel, AOT dispatch)."""
    model = tiny_model()
    ids = torch.randint(3, 500, (2, 9), generator=gen(1))
    want = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    calls = []
    original = ops.compress_token_

    class Counting:
        def __call__(self, *args):
            calls.append(args[4].shape)
            return original(*args)

    monkeypatch.setattr(torch.ops.dsflash, "compress_token_", Counting(), raising=False)
    for layer in model.model.layers:
        layer.attn.compress_op = True
    got = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    sources = sum(layer.attn.compressor is not None for layer in model.model.layers)
    assert sources >= 2 and len(calls) == 3 * sources and all(s[:2] == (2, 1) for s in calls)  # decode steps only
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    monkeypatch.undo()
    for case in (step_inputs(21), step_inputs(22, ratio=1), step_inputs(23, keys=False),
                 step_inputs(24, compressed_fmt="bf16", index_fmt="bf16")):
        torch.library.opcheck(ops.compress_token_.default, args_of(case))


def test_errors_name_the_problem():
    inp = step_inputs(31)
    two = dict(inp, kv=torch.cat([inp["kv"]] * 2, 1), score=torch.cat([inp["score"]] * 2, 1))
    with pytest.raises(ValueError, match="one token a batch row"):
        ops.compress_token_(*args_of(two))
    with pytest.raises(ValueError, match="come together"):
        ops.compress_token_(*args_of(dict(inp, pending_score=None)))
    with pytest.raises(ValueError, match="key_weight must be bf16"):
        ops.compress_token_(*args_of(dict(inp, key_weight=inp["key_weight"][:, :32])))
    with pytest.raises(TypeError, match="pools fp32 kv and score"):
        ops.compress_token_(*args_of(dict(inp, kv=inp["kv"].bfloat16())))
    with pytest.raises(ValueError, match="index_keys has"):
        ops.compress_token_(*args_of(dict(inp, index_keys=inp["index_keys"][:, :8])))


@pytest.mark.parametrize("ratio", [2, 1])
def test_release_launch_compiles_for_hopper(ratio):
    """The release's launch (rows of 512, keys of 128 in MXFP4, NVFP4 rows, wk asked of L2) compiles for sm_90 without
    spills."""
    from dsflash_compile.custom_ops import compress_token_triton as module

    ptr = {name: "*fp32" for name in ("kv_ptr", "score_ptr", "pkv_ptr", "pscore_ptr", "rot_ptr")}
    if ratio == 1:
        ptr["kv_ptr"] = "*bf16"
    ptr.update({name: "*bf16" for name in ("norm_w_ptr", "w_ptr", "key_norm_w_ptr")})
    ptr.update({name: "*u8" for name in ("comp_ptr", "keys_ptr")})
    ptr.update({name: "*i64" for name in ("source_ptr", "complete_ptr", "row_ptr")})
    ints = {name: "i64" for name in ("kv_sb", "score_sb", "pend_sb", "source_sb", "row_sb", "rot_sb", "comp_sb",
                                     "comp_sn", "keys_sb", "keys_sn", "rows")}
    args = dict(ptr, **ints, eps="fp32", key_eps="fp32")
    ordered = {name: args[name] for name in module._compress_token_kernel.arg_names if name in args}
    constexprs = dict(D=512, DK=128, PAIRS=32, R=ratio, RP=ratio, COMP_FMT=2, COMP_G=16, KEY_FMT=3, KEY_G=32,
                      BLOCK_K=module.BLOCK_K, PREFETCH_K=512)
    check_compiles_for_hopper(module, ("_compress_token_kernel", ordered, constexprs, 4))
