"""The indexer's Triton kernels (custom_ops/indexer_triton.py: dense and candidate-only scores, candidate
blocks; the candidate top-k of topk_triton.py) against the reference ops: under the Triton interpreter on
CPU at small sizes (in a subprocess, see interp.py), and on CUDA at the release's sizes (skipped without
a GPU). Scores agree within bf16 rounding-order differences; block ids and top-k picks exactly."""

import pytest
import torch

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from interp import report, run_interpreted, requires_interpreter
from hopper import check_compiles_for_hopper, compile_for_hopper, global_accesses_by_line

ops = torch.ops.dsflash
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (batch, seq, heads, dim, rows, blocks kept, block size, key format), column tiles per program
CANDIDATE_CASES = {
    "bf16": ((2, 3, 8, 64, 40, 4, 4, "bf16"), None),
    "mxfp4": ((2, 3, 8, 64, 40, 4, 4, "mxfp4"), None),
    "release_heads_tile_runs": ((1, 2, 32, 128, 150, 14, 8, "mxfp4"), 2),
}
# name: (batch, seq, heads, dim, rows, blocks kept, block size, key format), overrides of the union path
# (tokens per group, union blocks per step, programs per group), how the lists are made: "overlap"
# (neighbours share most blocks, as layer 20 publishes them), "random" (independent), "unsorted" /
# "duplicate" / "gap" (not candidate_blocks' layout: the group falls back to columns one token at a time)
UNION_CASES = {
    "overlap_mxfp4": ((2, 7, 8, 64, 120, 9, 4, "mxfp4"), dict(tokens_per_group=4, union_blocks=4, parts=1), "overlap"),
    "overlap_bf16_parts": ((1, 9, 8, 64, 160, 12, 4, "bf16"), dict(tokens_per_group=4, union_blocks=4, parts=3),
                           "overlap"),
    "random_mxfp4_parts": ((1, 8, 8, 64, 96, 6, 8, "mxfp4"), dict(tokens_per_group=2, union_blocks=2, parts=2),
                           "random"),
    "release_heads_defaults": ((1, 6, 32, 128, 160, 12, 8, "mxfp4"), dict(), "overlap"),
    "unsorted_fallback": ((1, 8, 8, 64, 120, 9, 4, "mxfp4"), dict(tokens_per_group=4, union_blocks=4, parts=2),
                          "unsorted"),
    "duplicate_fallback": ((1, 5, 8, 64, 120, 9, 4, "bf16"), dict(tokens_per_group=4, union_blocks=4, parts=1),
                           "duplicate"),
    "gap_fallback": ((1, 4, 8, 64, 120, 9, 4, "mxfp4"), dict(tokens_per_group=4, union_blocks=4, parts=1), "gap"),
}
# name: (batch, seq, heads, dim, key rows stored, num_rows, key format), query tokens per tile, key tiles
# per program (None: the defaults)
DENSE_CASES = {
    "bf16_prefill": ((2, 5, 8, 64, 150, 140, "bf16"), None, None),
    "mxfp4_release_prefill": ((1, 6, 32, 128, 200, 190, "mxfp4"), None, None),
    "mxfp4_release_decode_tile_runs": ((2, 1, 32, 128, 330, 330, "mxfp4"), None, 2),
    "few_heads_two_tokens_per_tile": ((1, 6, 4, 32, 70, 70, "bf16"), 2, 3),
}
# name: (topk_blocks, block size, top-k programs per row, top-k tile); scores of the dense cases
BLOCK_CASES = {"few_blocks": (3, 4, 1, 64), "more_blocks_than_rows": (100, 8, 2, 64), "split_rows": (5, 8, 3, 16)}


def make_keys(batch, rows, dim, fmt, g):
    """(keys as the kernel reads them, the same keys as bf16 rows)."""
    from dsflash_compile.custom_ops import records

    keys = torch.randn(batch, rows, dim, generator=g).bfloat16()
    if fmt == "bf16":
        return keys, keys
    stored = records.encode_reference(keys, fmt)
    return stored, records.decode_reference(stored, fmt, dim)


def make_candidate_case(batch, seq, heads, dim, rows, kept, block_size, fmt, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g).bfloat16()
    weights = (torch.randn(batch, seq, heads, generator=g) * 0.1).bfloat16()
    keys = make_keys(batch, rows, dim, fmt, g)[0]
    n_blocks = -(-rows // block_size)
    blocks = torch.stack([torch.randperm(n_blocks, generator=g)[:kept].sort().values for _ in range(batch * seq)])
    blocks = blocks.view(batch, seq, kept).to(torch.int32)
    blocks[0, 0, -1] = -1  # a query that kept fewer blocks
    visible = torch.randint(rows // 2, rows + 1, (batch, seq), generator=g)
    return q, weights, keys, blocks, block_size, visible, fmt


def overlapping_blocks(batch, seq, n_blocks, kept, g, spread=0.3):
    """Candidate lists as layer 20 publishes them for neighbouring queries: each token's top `kept` of a
    block score shared by the sequence plus a small per-token part (most blocks shared, not all), ascending,
    int32; the first token of each sequence keeps fewer (-1 tail)."""
    base = torch.randn(batch, 1, n_blocks, generator=g)
    score = base + spread * torch.randn(batch, seq, n_blocks, generator=g)
    blocks = score.topk(kept, -1).indices.sort(-1).values.to(torch.int32)
    blocks[:, 0, -2:] = -1
    return blocks


def make_union_case(batch, seq, heads, dim, rows, kept, block_size, fmt, lists, seed=0):
    """make_candidate_case with lists made as UNION_CASES says, and visibility ramping over the chunk."""
    q, weights, keys, blocks, _, _, _ = make_candidate_case(batch, seq, heads, dim, rows, kept, block_size, fmt, seed)
    g = torch.Generator().manual_seed(seed + 1)
    n_blocks = -(-rows // block_size)
    if lists != "random":
        blocks = overlapping_blocks(batch, seq, n_blocks, kept, g)
    if lists == "unsorted":
        blocks[0, 1] = blocks[0, 1].flip(-1)
    elif lists == "duplicate":
        blocks[0, 2, 3] = blocks[0, 2, 2]
    elif lists == "gap":
        blocks[0, 3, 2] = -1
    visible = (rows - seq + 1 + torch.arange(seq)).repeat(batch, 1)  # causal chunk at the end of the context
    visible[0, 0] = rows // 3
    return q, weights, keys, blocks, block_size, visible, fmt


def make_dense_case(batch, seq, heads, dim, rows, num_rows, fmt, seed=0, device="cpu"):
    """(q, weights, stored keys, visible, num_rows, fmt) and the keys as bf16. One query sees nothing."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g).bfloat16()
    weights = (torch.randn(batch, seq, heads, generator=g) * (heads * dim) ** -0.5).bfloat16()
    keys, keys_bf16 = make_keys(batch, rows, dim, fmt, g)
    visible = torch.randint(0, num_rows + 1, (batch, seq), generator=g)
    visible[0, 0] = 0
    visible[-1, -1] = num_rows
    args = [x.to(device) for x in (q, weights, keys, visible)]
    return (*args, num_rows, fmt), keys_bf16.to(device)


def score_errors(out, ref, q, weights, keys_bf16):
    """Same -inf pattern?, and the worst error in units of 2^-8 x sum_h |w_h| relu(q_h . k) (the size the
    bf16 rounding points scale with, cancellation between heads of both signs included)."""
    dots = torch.einsum("bshd,btd->bsht", q.float(), keys_bf16.float()).relu()
    magnitude = (dots * weights.float().abs().unsqueeze(-1)).sum(2)
    if magnitude.shape[-1] > ref.shape[-1]:
        magnitude = magnitude[..., :ref.shape[-1]]
    finite = ref.isfinite()
    ulps = ((out.float() - ref.float()).abs() / (2 ** -8 * magnitude + 1e-30))[finite]
    return bool(torch.equal(finite, out.isfinite())), (ulps.max().item() if ulps.numel() else 0.0)


def interpreter_checks():
    """Entry point of the subprocess: every kernel against its reference."""
    from dsflash_compile.custom_ops.indexer import (candidate_blocks_reference, candidate_scores_reference,
                                                    candidate_topk_reference, indexer_scores_reference)
    from dsflash_compile.custom_ops.indexer_triton import (candidate_blocks_triton, candidate_scores_triton,
                                                           indexer_scores_triton)
    from dsflash_compile.custom_ops.topk_triton import candidate_topk_triton

    for name, (shape, tiles_per_program) in CANDIDATE_CASES.items():
        args = make_candidate_case(*shape)
        ref = candidate_scores_reference(*args)
        out = candidate_scores_triton(*args, tiles_per_program=tiles_per_program)
        finite = ref.isfinite()
        scale = ref[finite].float().abs().max().item()
        report(dict(name="candidate_" + name, same_masked=bool(torch.equal(finite, out.isfinite())),
                    max_err=(out[finite].float() - ref[finite].float()).abs().max().item(), scale=scale))
        # top-k in the compact space: the reference's own scores (exact ties: bf16), k above the finite count
        blocks, block_size = args[3], args[4]
        for k in (3, ref.shape[-1]):
            same = torch.equal(candidate_topk_triton(ref, blocks, block_size, k, split=2, block=16),
                               candidate_topk_reference(ref, blocks, block_size, k))
            report(dict(name=f"candidate_topk_{name}_k{k}", same=same))

    for name, (shape, overrides, lists) in UNION_CASES.items():
        args = make_union_case(*shape, lists)
        ref = candidate_scores_reference(*args)
        out = candidate_scores_triton(*args, union=True, **overrides)
        finite = ref.isfinite()
        scale = ref[finite].float().abs().max().item()
        per_token = candidate_scores_triton(*args, union=False)
        report(dict(name="union_" + name, same_masked=bool(torch.equal(finite, out.isfinite())),
                    max_err=(out[finite].float() - ref[finite].float()).abs().max().item(), scale=scale,
                    same_as_per_token=bool(torch.equal(out, per_token))))
        # top-k of the same scores on the row-wise path (chunk 32: three stages for k 5)
        blocks, block_size = args[3], args[4]
        same = torch.equal(candidate_topk_triton(ref, blocks, block_size, 5, chunk=32),
                           candidate_topk_reference(ref, blocks, block_size, 5))
        report(dict(name=f"candidate_topk_rowwise_{name}", same=same))

    for name, (shape, tokens_per_tile, tiles_per_program) in DENSE_CASES.items():
        args, keys_bf16 = make_dense_case(*shape)
        q, weights, _, visible, num_rows, _ = args
        ref = indexer_scores_reference(q, weights, keys_bf16, visible, num_rows)
        out = indexer_scores_triton(*args, tokens_per_tile=tokens_per_tile, tiles_per_program=tiles_per_program)
        same_masked, ulps = score_errors(out, ref, q, weights, keys_bf16[:, :num_rows])
        report(dict(name="dense_" + name, same_masked=same_masked, ulps=ulps))
        for block_name, (topk_blocks, block_size, split, tile) in BLOCK_CASES.items():
            same = torch.equal(candidate_blocks_triton(ref, visible, topk_blocks, block_size, split, tile),
                               candidate_blocks_reference(ref, visible, topk_blocks, block_size))
            report(dict(name=f"blocks_{name}_{block_name}", same=same))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_indexer_triton", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CANDIDATE_CASES))
def test_candidate_scores_kernel_matches_reference(interpreted, name):
    """Same -inf pattern (invalid blocks, rows past visibility); finite scores within 4 bf16 ulps of the
    score scale (the interpreter truncates where the GPU rounds, and sums in another order)."""
    result = interpreted["candidate_" + name]
    assert result["same_masked"], result
    assert result["max_err"] <= 4 * 2 ** -8 * result["scale"], result


@requires_interpreter
@pytest.mark.parametrize("name", list(UNION_CASES))
def test_candidate_scores_union_path_matches_reference(interpreted, name):
    """The prefill (union) path: the same -inf pattern as the reference (rows past each token's own
    visibility, -1 blocks, blocks a neighbour has and this token lacks are not written) and finite scores
    within 4 bf16 ulps of the score scale; overlapping, independent and malformed lists (fallback),
    tokens past the sequence in the last group, several programs per group."""
    result = interpreted["union_" + name]
    assert result["same_masked"], result
    assert result["max_err"] <= 4 * 2 ** -8 * result["scale"], result
    assert result["same_as_per_token"], result  # the same rounding points: bit for bit under the interpreter


@requires_interpreter
@pytest.mark.parametrize("name", list(UNION_CASES))
def test_candidate_topk_rowwise_equals_reference(interpreted, name):
    """candidate_topk on the row-wise top-k path: the reference's rows exactly (remap, -1 for -inf)."""
    assert interpreted["candidate_topk_rowwise_" + name]["same"]


@requires_interpreter
@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_dense_scores_kernel_matches_reference(interpreted, name):
    """Same -inf pattern (rows past visibility, a query that sees nothing); finite scores within 8 x 2^-8
    of sum_h |w| relu(q.k): three bf16 rounding points, which the interpreter truncates (2^-7 each)."""
    result = interpreted["dense_" + name]
    assert result["same_masked"], result
    assert result["ulps"] <= 8, result


@requires_interpreter
@pytest.mark.parametrize("name", [f"{d}_{b}" for d in DENSE_CASES for b in BLOCK_CASES])
def test_candidate_blocks_kernel_equals_reference(interpreted, name):
    """Block ids exactly as the reference: pinned newest block, fewer blocks than topk_blocks, a query
    with nothing visible (all -1), ties between equal block maxima to the lower block."""
    assert interpreted["blocks_" + name]["same"]


@requires_interpreter
@pytest.mark.parametrize("name", [f"{c}_k{k}" for c in CANDIDATE_CASES for k in ("3", "all")])
def test_candidate_topk_kernel_equals_reference(interpreted, name):
    """Rows picked in the compact space exactly as the reference, with -1 for -inf picks (k = width)."""
    case, k = name.rsplit("_k", 1)
    if k == "all":
        shape = CANDIDATE_CASES[case][0]
        k = str(shape[5] * shape[6])
    assert interpreted[f"candidate_topk_{case}_k{k}"]["same"]


def test_indexer_scores_reads_records_opcheck():
    """The fmt argument: MXFP4 records give the scores of their decoded rows; opcheck of the new schema;
    an unknown format or records passed as bf16 rows are clear errors."""
    args, keys_bf16 = make_dense_case(2, 3, 8, 64, 20, 16, "mxfp4")
    q, weights, stored, visible, num_rows, fmt = args
    assert torch.equal(ops.indexer_scores(*args), ops.indexer_scores(q, weights, keys_bf16, visible, num_rows))
    torch.library.opcheck(ops.indexer_scores.default, args)
    with pytest.raises(ValueError, match="unknown record format"):
        ops.indexer_scores(q, weights, stored, visible, num_rows, "nvfp8")
    with pytest.raises(ValueError, match="floating-point key rows"):
        ops.indexer_scores(q, weights, stored, visible, num_rows)


_SCORING_ARGS = dict(q_ptr="*bf16", w_ptr="*bf16", visible_ptr="*i64", out_ptr="*bf16", S="i32", keys_sb="i64",
                     keys_sr="i32")
INDEXER_KERNELS = {  # name: (kernel, args, constexprs, num_warps), as the wrappers launch them at release dims
    f"dense_{fmt}_tq{tq}": ("_dense_scores_kernel",
                            dict(_SCORING_ARGS, keys_ptr="*u8" if fmt == "mxfp4" else "*bf16", num_rows="i32",
                                 tiles_per_program="i32"),
                            dict(H=32, HP=32, D=128, TQ=tq, BLOCK_N=64, MXFP4=fmt == "mxfp4", FP32_DOT=False),
                            4 if tq == 1 else 8)
    for fmt in ("mxfp4", "bf16") for tq in (1, 4)
} | {
    f"candidate_{fmt}": ("_candidate_scores_kernel",
                         dict(_SCORING_ARGS, keys_ptr="*u8" if fmt == "mxfp4" else "*bf16", blocks_ptr="*i32",
                              NB="i32", tiles_per_program="i32"),
                         dict(H=32, HP=32, D=128, BS=8, BLOCK_C=32, MXFP4=fmt == "mxfp4", FP32_DOT=False), 4)
    for fmt in ("mxfp4", "bf16")
} | {
    f"candidate_union_{fmt}": ("_candidate_union_kernel",
                               dict(_SCORING_ARGS, keys_ptr="*u8" if fmt == "mxfp4" else "*bf16", blocks_ptr="*i32",
                                    NB="i32", parts="i32"),
                               dict(H=32, HP=32, D=128, BS=8, TQ=4, NU=8, SCAN=512, BLOCK_C=32, MXFP4=fmt == "mxfp4",
                                    FP32_DOT=False), 8)
    for fmt in ("mxfp4", "bf16")
} | {
    "block_max": ("_block_max_kernel", dict(scores_ptr="*bf16", visible_ptr="*i64", out_ptr="*bf16", width="i32",
                                            n_blocks="i32"), dict(BS=8, BS_P2=8, BLOCK_B=128), 4),
}


@pytest.mark.parametrize("name", [name for name in INDEXER_KERNELS if "mxfp4" in name])
def test_mxfp4_records_are_read_at_their_alignment(name):
    """MXFP4 index-key records are 68 B, so a record starts 4-byte aligned at best: sm_90 code must read
    them in accesses of at most 4 bytes. The union kernel once read them in 8-byte vectors (Triton took
    its computed rows for multiples of 8) and faulted with a misaligned address on the H200; the launch's
    16-divisible arguments are what made the vectors, so they are specialized here as at run time."""
    import inspect

    from dsflash_compile.custom_ops import indexer_triton

    spec = INDEXER_KERNELS[name]
    wide = [arg for arg, kind in spec[1].items() if kind.startswith("*")] + ["S", "keys_sb", "NB"]
    ptx = compile_for_hopper(indexer_triton, spec, [arg for arg in wide if arg in spec[1]]).asm["ptx"]
    source, first = inspect.getsourcelines(indexer_triton._load_keys.fn)
    record_lines = [first + i for i, line in enumerate(source) if "tl.load(ptr + " in line and "D // " in line]
    assert len(record_lines) == 2  # the packed values and the scales
    accesses = global_accesses_by_line(ptx)
    widths = {op for line in record_lines for op in accesses[("indexer_triton.py", line)]}
    assert widths and widths <= {"ld.global.b8", "ld.global.b16", "ld.global.b32"}, widths


@pytest.mark.parametrize("name", list(INDEXER_KERNELS))
def test_indexer_kernels_compile_for_hopper(name):
    """Every release variant compiles for sm_90 (tensor-core dots on bf16) without spilling registers."""
    from dsflash_compile.custom_ops import indexer_triton

    check_compiles_for_hopper(indexer_triton, INDEXER_KERNELS[name])


# ----------------------------------------------------------------------------------------------- CUDA


def release_candidates(batch, seq, rows, device="cuda", seed=0):
    """Release shapes: 32 heads x 128, MXFP4 keys, candidates 2048 blocks of 8 (ascending, some -1)."""
    (q, weights, keys, visible, num_rows, fmt), keys_bf16 = make_dense_case(batch, seq, 32, 128, rows, rows,
                                                                            "mxfp4", seed, device)
    visible = visible.clamp_min(1)
    n_blocks = -(-rows // 8)
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = torch.rand(batch, seq, n_blocks, generator=g, device=device).topk(min(2048, n_blocks), -1).indices
    blocks = blocks.sort(-1).values.to(torch.int32)
    blocks[0, 0, -5:] = -1
    return q, weights, keys, keys_bf16, blocks, visible


@requires_cuda
@pytest.mark.parametrize("batch,seq,rows", [(1, 1, 8192), (8, 1, 40000), (1, 64, 20000)])
def test_dense_scores_cuda(batch, seq, rows):
    """The registered CUDA op (Triton, MXFP4 records read in place) against the reference on the decoded
    keys: same -inf pattern, within 6 x 2^-8 of sum_h |w| relu(q.k) (rounding order only: at most one bf16
    ulp, 2^-7 relative, at each of the 3 rounding points)."""
    from dsflash_compile.custom_ops.indexer import indexer_scores_reference

    (q, weights, keys, visible, num_rows, fmt), keys_bf16 = make_dense_case(batch, seq, 32, 128, rows + 100, rows,
                                                                            "mxfp4", device="cuda")
    out = ops.indexer_scores(q, weights, keys, visible, num_rows, fmt)
    ref = indexer_scores_reference(q, weights, keys_bf16, visible, num_rows)
    same_masked, ulps = score_errors(out, ref, q, weights, keys_bf16[:, :num_rows])
    print(f"dense {batch}x{seq}x{rows}: {'PASS' if same_masked and ulps <= 6 else 'FAIL'} "
          f"(same -inf: {same_masked}, worst {ulps:.2f} x 2^-8 magnitude)")
    assert same_masked and ulps <= 6


@requires_cuda
@pytest.mark.parametrize("batch,seq,rows", [(2, 2, 40000), (1, 1, 5000), (4, 16, 20000)])
def test_candidate_path_cuda(batch, seq, rows):
    """candidate_scores (Triton) vs the reference within 4 x 2^-8 of the score scale; candidate_topk
    (Triton) picks exactly what the reference picks from the same scores."""
    from dsflash_compile.custom_ops.indexer import candidate_scores_reference, candidate_topk_reference

    q, weights, keys, _, blocks, visible = release_candidates(batch, seq, rows)
    out = ops.candidate_scores(q, weights, keys, blocks, 8, visible, "mxfp4")
    ref = candidate_scores_reference(q, weights, keys, blocks, 8, visible, "mxfp4")
    finite = ref.isfinite()
    err = (out[finite].float() - ref[finite].float()).abs().max().item()
    scale = ref[finite].float().abs().max().item()
    k = min(512, rows)
    same_topk = torch.equal(ops.candidate_topk(ref, blocks, 8, k), candidate_topk_reference(ref, blocks, 8, k))
    ok = torch.equal(finite, out.isfinite()) and err <= 4 * 2 ** -8 * scale and same_topk
    print(f"candidate {batch}x{seq}x{rows}: {'PASS' if ok else 'FAIL'} (max err {err:.3g} at scale {scale:.3g}, "
          f"top-k equal: {same_topk})")
    assert ok


@requires_cuda
@pytest.mark.parametrize("batch,seq,rows,lists", [(1, 64, 100000, "overlap"), (2, 37, 30000, "overlap"),
                                                   (1, 16, 20000, "random"), (1, 8, 9000, "unsorted")])
def test_candidate_union_path_cuda(batch, seq, rows, lists):
    """The prefill (union) path the op picks for >= 4 tokens: release shapes, neighbours' overlapping lists,
    independent lists, and a malformed list (its group falls back): against the reference within 4 x 2^-8
    of the score scale, the same -inf pattern; and candidate_topk (row-wise or radix, by shape) exact."""
    from dsflash_compile.custom_ops.indexer import candidate_scores_reference, candidate_topk_reference
    from dsflash_compile.custom_ops.indexer_triton import candidate_scores_triton

    q, weights, keys, _, blocks, visible = release_candidates(batch, seq, rows)
    if lists != "random":
        blocks = overlapping_blocks(batch, seq, -(-rows // 8), blocks.shape[-1], torch.Generator().manual_seed(1))
        blocks = blocks.cuda()
    if lists == "unsorted":
        blocks[0, 5] = blocks[0, 5].flip(-1)
    out = candidate_scores_triton(q, weights, keys, blocks, 8, visible, "mxfp4", union=True)
    ref = candidate_scores_reference(q, weights, keys, blocks, 8, visible, "mxfp4")
    finite = ref.isfinite()
    err = (out[finite].float() - ref[finite].float()).abs().max().item()
    scale = ref[finite].float().abs().max().item()
    same_topk = torch.equal(ops.candidate_topk(ref, blocks, 8, 512), candidate_topk_reference(ref, blocks, 8, 512))
    ok = torch.equal(finite, out.isfinite()) and err <= 4 * 2 ** -8 * scale and same_topk
    print(f"candidate union {batch}x{seq}x{rows} {lists}: {'PASS' if ok else 'FAIL'} (max err {err:.3g} at scale "
          f"{scale:.3g}, top-k equal: {same_topk})")
    assert ok


@requires_cuda
@pytest.mark.parametrize("batch,seq,rows", [(1, 1, 8192), (8, 1, 131072), (1, 256, 40000), (2, 4, 3000)])
def test_candidate_blocks_cuda(batch, seq, rows):
    """Block ids (Triton block max + radix top-k) exactly as the reference, from the same bf16 scores."""
    from dsflash_compile.custom_ops.indexer import candidate_blocks_reference, indexer_scores_reference

    (q, weights, _, visible, num_rows, _), keys_bf16 = make_dense_case(batch, seq, 32, 128, rows, rows, "mxfp4",
                                                                       device="cuda")
    scores = indexer_scores_reference(q, weights, keys_bf16, visible, num_rows)
    out = ops.candidate_blocks(scores, visible, 2048, 8)
    ref = candidate_blocks_reference(scores, visible, 2048, 8)
    bad = (out != ref).any(-1).sum().item()
    print(f"candidate blocks {batch}x{seq}x{rows}: {'PASS' if bad == 0 else 'FAIL'} ({bad} queries differ)")
    assert bad == 0


@requires_cuda
def test_indexer_ops_cuda_graph_replay():
    """Dense scores, candidate blocks, candidate scores and top-k captured in one CUDA graph replay to the
    eager results on new inputs (no host sync, no data-dependent allocation)."""
    q, weights, keys, _, blocks, visible = release_candidates(2, 1, 30000)

    def layer():
        dense = ops.indexer_scores(q, weights, keys, visible, 30000, "mxfp4")
        picked = ops.candidate_blocks(dense, visible, 2048, 8)
        scores = ops.candidate_scores(q, weights, keys, picked, 8, visible, "mxfp4")
        return ops.topk_indices(dense, 512, visible), ops.candidate_topk(scores, picked, 8, 512)

    layer()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer()
    q.copy_(torch.randn_like(q.float()).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, layer()):
        assert torch.equal(got, want)


@requires_cuda
def test_cuda_kernels_opcheck():
    """opcheck of every indexer op with CUDA inputs (the registered Triton kernels against their schemas and
    fake kernels)."""
    q, weights, keys, _, blocks, visible = release_candidates(1, 2, 3000)
    dense = ops.indexer_scores(q, weights, keys, visible, 3000, "mxfp4")
    compact = ops.candidate_scores(q, weights, keys, blocks, 8, visible, "mxfp4")
    for op, args in ((ops.indexer_scores.default, (q, weights, keys, visible, 3000, "mxfp4")),
                     (ops.candidate_blocks.default, (dense, visible, 2048, 8)),
                     (ops.candidate_scores.default, (q, weights, keys, blocks, 8, visible, "mxfp4")),
                     (ops.candidate_topk.default, (compact, blocks, 8, 512)),
                     (ops.topk_indices.default, (dense, 512, visible))):
        torch.library.opcheck(op, args)
