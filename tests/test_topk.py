"""The radix-select top-k kernels (custom_ops/topk_triton.py) against top_k_stable and the reference op:
under the Triton interpreter on CPU at small sizes (in a subprocess, see interp.py), and on CUDA at the
release's sizes (skipped without a GPU). Picks must be equal exactly, ties included (lower index wins)."""

import pytest
import torch

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
try:
    from dsflash_compile.custom_ops.topk_triton import FILTER_VARIANTS
except ImportError:  # no triton: the compile checks skip
    FILTER_VARIANTS = []
from hopper import check_compiles_for_hopper
from interp import report, run_interpreted, requires_interpreter

ops = torch.ops.dsflash
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = {  # name: (rows, width, k, dtype, split, tile)
    "bf16_one_program": (3, 700, 40, torch.bfloat16, 1, 256),
    "bf16_split_rows": (2, 3000, 100, torch.bfloat16, 3, 256),
    "fp32_split_rows": (2, 2500, 300, torch.float32, 4, 256),
    "fp16": (2, 600, 33, torch.float16, 2, 128),
    "k_equals_width": (2, 300, 300, torch.bfloat16, 2, 128),
    "k_one": (3, 500, 1, torch.float32, 2, 128),
    "release_k": (2, 4096, 512, torch.bfloat16, 4, 512),
}
ROWWISE_CASES = {  # name: (rows, width, k, dtype, chunk): the row-wise path (one chunk, or stages of chunks)
    "rowwise_bf16_one_chunk": (4, 500, 40, torch.bfloat16, 512),
    "rowwise_bf16_three_stages": (3, 3000, 40, torch.bfloat16, 256),
    "rowwise_fp32_stages": (3, 2500, 100, torch.float32, 256),
    "rowwise_fp16_short_last_chunk": (2, 600, 33, torch.float16, 128),
    "rowwise_k_half_chunk": (3, 700, 64, torch.bfloat16, 128),
    "rowwise_k_one": (3, 900, 1, torch.float32, 128),
    "rowwise_k_equals_width": (2, 64, 64, torch.bfloat16, 128),
}

FILTER_CASES = {  # name: (rows, width, k, dtype, groups, sample, cand, block, periodic rows): the filter path
    "filter_bf16_ties_inf": (4, 3000, 40, torch.bfloat16, 128, 2, 256, 256, ()),
    "filter_fp32_every_line": (3, 2500, 100, torch.float32, 256, 1, 1024, 512, ()),
    "filter_fp16_sample4": (3, 5000, 33, torch.float16, 64, 4, 256, 128, ()),
    "filter_k_one": (3, 900, 1, torch.bfloat16, 64, 2, 128, 128, ()),
    "filter_overflow_fallback": (5, 3000, 40, torch.bfloat16, 128, 2, 256, 256, (3, 4)),
    "filter_fp32_overflow_fallback": (4, 2000, 20, torch.float32, 64, 2, 128, 128, (0,)),
}
SEGMENTED_CASES = {  # name: (rows, width, k, dtype, groups, sample, cand, block, segments, periodic rows)
    "segmented_bf16_ties_inf": (4, 3000, 40, torch.bfloat16, 128, 2, 256, 256, 3, ()),
    "segmented_fp32_last_below_k": (3, 2350, 60, torch.float32, 64, 1, 512, 256, 4, ()),  # 46 entries last
    "segmented_two_stages": (1, 40000, 40, torch.float16, 64, 2, 512, 128, 120, ()),  # 105 x 40 > CHUNK
    "segmented_overflow_fallback": (4, 3000, 40, torch.bfloat16, 128, 1, 256, 256, 3, (2, 3)),
}

SINGLE_CASES = {  # name: (rows, width, k, dtype): the single path through the three ops that finish with it
    "single_bf16": (3, 700, 40, torch.bfloat16),
    "single_fp32_k_equals_width": (3, 300, 300, torch.float32),
    "single_fp16_k_one": (3, 300, 1, torch.float16),
    "single_release_k": (4, 2060, 512, torch.bfloat16),
    "single_ties_across_parts": (4, 600, 150, torch.bfloat16),  # row 3's top: a tie run across 512 (split)
}
# candidate_topk on the single path, by how the blocks are laid out: candidate_blocks' layout (ascending, -1
# last), reversed (unordered: the kernel sorts), a -1 block whose scores are finite (its -1 sorts first)
CANDIDATE_LAYOUTS = ("ascending", "reversed", "finite_in_dropped")


def make_candidates(rows, n_blocks, kept, block_size, layout, seed=0):
    """(compact scores [rows, kept x block_size], blocks [rows, kept]) of one layout of CANDIDATE_LAYOUTS;
    row 0 keeps fewer blocks (its last ones -1, their scores -inf)."""
    g = torch.Generator().manual_seed(seed)
    scores = make_scores(rows, kept * block_size, torch.bfloat16, seed=seed)
    blocks = torch.stack([torch.randperm(n_blocks, generator=g)[:kept].sort().values for _ in range(rows)]).int()
    blocks[0, -3:] = -1
    scores[0, -3 * block_size:] = float("-inf")
    if layout == "reversed":
        blocks[-1] = blocks[-1].flip(-1)
    if layout == "finite_in_dropped":
        blocks[-1, 2] = -1
    return scores, blocks


def make_scores(rows, width, dtype, seed=0, device="cpu"):
    """Random scores with what the indexer produces: exact ties (a run of equal values across the cut,
    +0 and -0), an all -inf row and -inf tails (rows not yet visible)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, width, generator=g, device=device).to(dtype)
    x[0, width // 5: width // 2] = x[0].float().quantile(0.9).to(dtype)  # many ties at the cut
    x[0, :7] = 0.0
    x[0, 7:14] = -0.0
    if rows > 1:
        x[1] = float("-inf")
    if rows > 2:
        x[2, width // 3:] = float("-inf")
    return x


def make_visible(rows, width, k, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed + 1)
    visible = torch.randint(0, width + 1, (rows,), generator=g, device=device)
    visible[0] = min(k // 2, width)  # fewer visible rows than k
    return visible


def interpreter_checks():
    """Entry point of the subprocess: picks of every case against the reference."""
    from dsflash_compile.custom_ops import topk_triton
    from dsflash_compile.custom_ops.topk import top_k_stable, topk_indices_reference
    from dsflash_compile.custom_ops.topk_triton import (VISIBLE, finish, select_filtered, select_topk,
                                                        topk_indices_triton)

    for name, (rows, width, k, dtype, split, tile) in CASES.items():
        scores = make_scores(rows, width, dtype)
        picks = select_topk(scores, k, split, tile).long().sort(-1).values
        want = top_k_stable(scores, k)[1].sort(-1).values
        visible = make_visible(rows, width, k)
        out = topk_indices_triton(scores.view(1, rows, width), k, visible.view(1, rows), split, tile)
        ref = topk_indices_reference(scores.view(1, rows, width), k, visible.view(1, rows))
        report(dict(name=name, same_picks=bool(torch.equal(picks, want)), same_op=bool(torch.equal(out, ref))))
    for name, (rows, width, k, dtype, chunk) in ROWWISE_CASES.items():
        scores = make_scores(rows, width, dtype, seed=3)
        picks = select_topk(scores, k, chunk=chunk).long()
        want = top_k_stable(scores, k)[1].sort(-1).values
        visible = make_visible(rows, width, k, seed=3)
        out = topk_indices_triton(scores.view(1, rows, width), k, visible.view(1, rows), chunk=chunk)
        ref = topk_indices_reference(scores.view(1, rows, width), k, visible.view(1, rows))
        report(dict(name=name, same_picks=bool(torch.equal(picks, want)), same_op=bool(torch.equal(out, ref))))
    for name, (rows, width, k, dtype, groups, sample, cand, block, periodic) in FILTER_CASES.items():
        scores = make_scores(rows, width, dtype, seed=5)
        for row in periodic:  # a period of the group layout: far more than cand keys above the threshold
            scores[row] = (torch.arange(width) % (groups * sample)).to(dtype)
        flags = torch.zeros(rows, dtype=torch.int32)
        picks = select_filtered(scores, k, groups, sample, cand, block, flags=flags)
        want = top_k_stable(scores, k)[1].sort(-1).values
        visible = make_visible(rows, width, k, seed=5)
        out = finish(picks, VISIBLE, visible=visible)
        ref = topk_indices_reference(scores.view(1, rows, width), k, visible.view(1, rows)).view(rows, k)
        report(dict(name=name, same_picks=bool(torch.equal(picks.long().sort(-1).values, want)),
                    same_op=bool(torch.equal(out, ref)), flagged=flags.nonzero().flatten().tolist()))
    for name, (rows, width, k, dtype, groups, sample, cand, block, segments, periodic) in SEGMENTED_CASES.items():
        scores = make_scores(rows, width, dtype, seed=9)
        for row in periodic:  # every segment overflows
            scores[row] = (torch.arange(width) % (groups * sample)).to(dtype)
        flags = torch.ones(rows, dtype=torch.int32)  # (zeroed by the call)
        picks = select_filtered(scores, k, groups, sample, cand, block, flags=flags, segments=segments)
        want = top_k_stable(scores, k)[1].sort(-1).values
        report(dict(name=name, same_picks=bool(torch.equal(picks.long().sort(-1).values, want)),
                    flagged=flags.nonzero().flatten().tolist()))
    from dsflash_compile.custom_ops.indexer import candidate_blocks_reference, candidate_topk_reference
    from dsflash_compile.custom_ops.indexer_triton import candidate_blocks_triton
    topk_triton.SINGLE_ON = True
    defaults = topk_triton.SINGLE_SPLIT, topk_triton.SINGLE_RADIX
    # one tile of the next power of two; a power-of-two head and a tail; each with the k-th key by bisection or by
    # digits (radix: the three ops share the kernel's take, so only topk_indices' cases)
    for split, radix in ((False, False), (True, False), (False, True), (True, True)):
        topk_triton.SINGLE_SPLIT, topk_triton.SINGLE_RADIX = split, radix
        suffix = ("_split" if split else "") + ("_radix" if radix else "")
        for name, (rows, width, k, dtype) in SINGLE_CASES.items():
            scores = make_scores(rows, width, dtype, seed=11).view(1, rows, width)
            visible = make_visible(rows, width, k, seed=11).view(1, rows)
            if name == "single_ties_across_parts":  # 190 equal maxima, 150 picked: by position, 400-549
                scores[0, 3, 400:590] = scores[0, 3].max()
                visible[0, 3] = width
            assert topk_triton.single_fits(rows, width, k, scores.device)
            report(dict(name=name + suffix, parts=topk_triton.single_parts(width),
                        same_op=bool(torch.equal(topk_indices_triton(scores, k, visible),
                                                 topk_indices_reference(scores, k, visible)))))
        if radix:
            continue
        for layout in CANDIDATE_LAYOUTS:
            scores, blocks = make_candidates(3, 40, 20, 4, layout)
            out = topk_triton.candidate_topk_triton(scores, blocks, 4, 30)
            report(dict(name=f"single_candidates_{layout}{suffix}",
                        same_op=bool(torch.equal(out, candidate_topk_reference(scores, blocks, 4, 30)))))
        scores = make_scores(2, 515 * 8, torch.bfloat16, seed=4).view(1, 2, -1)  # fewer and more blocks than kept
        visible = torch.tensor([[4000, 300]])
        report(dict(name="single_candidate_blocks" + suffix, same_op=all(
            torch.equal(candidate_blocks_triton(scores, visible, kept, 8),
                        candidate_blocks_reference(scores, visible, kept, 8)) for kept in (2048, 100))))
    topk_triton.SINGLE_SPLIT, topk_triton.SINGLE_RADIX = defaults
    # tie-free random rows, the path chosen by shape (the interpreter's 8 "SMs"): row-wise for 16 rows of
    # one chunk, filter (FILTER_ON) for 16 rows wider than one (the default launch), segmented for 2 rows
    # (SEGMENTED_ON, segments of at least 2048 entries here)
    topk_triton.SEGMENTED_ON, topk_triton.SEGMENT = True, 2048
    for name, rows, width in (("rowwise_auto_tie_free", 16, 3000), ("filter_auto_tie_free", 16, 5000),
                              ("segmented_auto_tie_free", 2, 9000)):
        scores = torch.randperm(rows * width, generator=torch.Generator().manual_seed(7)).float().view(rows, width)
        picks = select_topk(scores - 20000, 50).long().sort(-1).values
        report(dict(name=name, same_picks=bool(torch.equal(picks, top_k_stable(scores, 50)[1].sort(-1).values)),
                    path=topk_triton.topk_path(rows, width, 50, scores.device)))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_topk", "interpreter_checks")


SINGLE_NAMES = list(SINGLE_CASES) + [f"single_candidates_{layout}" for layout in CANDIDATE_LAYOUTS] + [
    "single_candidate_blocks"]


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES) + list(ROWWISE_CASES) + list(FILTER_CASES) + list(SEGMENTED_CASES) +
                         SINGLE_NAMES + [f"{name}_split" for name in SINGLE_NAMES] +
                         [f"{name}{radix}" for radix in ("_radix", "_split_radix") for name in SINGLE_CASES] +
                         ["rowwise_auto_tie_free", "filter_auto_tie_free", "segmented_auto_tie_free"])
def test_topk_kernel_matches_reference(interpreted, name):
    """The same k indices as top_k_stable (ties to the lower index, -0 == +0, all -inf rows), and the op's
    output (ascending, -1 for picks past visible) equal to the reference; radix, row-wise and filter paths
    (the row-wise one also returns its picks ascending; select_topk picks row-wise or filter for many
    rows). Filter cases: exactly the periodic rows overflow their candidates and take the radix fallback;
    ties at the cut, all -inf rows and -inf tails (fewer finite entries than k) do not. Segmented cases: the
    same, with a short last segment, and enough segments for two row-wise stages after them. Single cases: the
    three ops that finish on the single path (topk_indices; candidate_topk over ascending, reversed and -1
    blocks with finite scores; candidate_blocks with fewer and more blocks than it keeps) equal the reference,
    the row as one tile and (_split, SINGLE_SPLIT) as a power-of-two head and a tail, a tie run at the cut across
    the two, the k-th largest key by bisection and (_radix, SINGLE_RADIX) by digits."""
    result = interpreted[name]  # (the single path's cases finish their picks: only the op's output is checked)
    assert result.get("same_picks", True) and result.get("same_op", True), result
    if "parts" in result:  # one tile, or (split) a power-of-two head and a tail
        assert (result["parts"][1] > 0) == ("_split" in name), result
    if name.endswith("_auto_tie_free"):  # the path the name says was the one chosen
        assert result["path"] == name.split("_")[0], result
    if name in FILTER_CASES or name in SEGMENTED_CASES:
        assert result["flagged"] == list({**FILTER_CASES, **SEGMENTED_CASES}[name][-1]), result


TOPK_KERNELS = {  # name: (kernel, args, constexprs, num_warps), as select_topk / finish launch them
    f"histogram_{bits}bit_pass{p}_tile{tile}_flagged{flagged}": (
        "_histogram_kernel", dict(bits_ptr=f"*i{bits}", hist_ptr="*i32", ties_ptr="*i32", flags_ptr="*i32",
                                  width="i32", chunk="i32", k="i32", SPLIT="i32"),
        dict(P=p, NPASS=bits // 8, KEY_BITS=bits, BLOCK=tile, FLAGGED=flagged), warps)
    for bits in (16, 32) for p in range(bits // 8) for tile, warps in ((4096, 8), (1024, 4))
    for flagged in (False, True)
} | {
    f"compact_{bits}bit_tile{tile}_flagged{flagged}": (
        "_compact_kernel", dict(bits_ptr=f"*i{bits}", hist_ptr="*i32", ties_ptr="*i32", count_ptr="*i32",
                                picks_ptr="*i32", flags_ptr="*i32", width="i32", chunk="i32", k="i32", SPLIT="i32"),
        dict(NPASS=bits // 8, KEY_BITS=bits, SPLIT_P2=4, BLOCK=tile, FLAGGED=flagged), warps)
    for bits in (16, 32) for tile, warps in ((4096, 8), (1024, 4)) for flagged in (False, True)
} | {
    f"filter_{bits}bit_groups{groups}_sample{sample}_cand{cand}_block{block}_warps{warps}_segmented{segmented}": (
        "_filter_kernel", dict(bits_ptr=f"*i{bits}", cand_ptr="*i32", picks_ptr="*i32", keys_ptr="*i32",
                               flags_ptr="*i32", width="i32", seg_width="i32", k="i32"),
        dict(KEY_BITS=bits, GROUPS=groups, SAMPLE=sample, CAND=cand, K_P2=512, BLOCK=block, SEGMENTED=segmented),
        warps)
    for bits, (groups, sample, cand, block, warps), segmented in [(32, variant, False) for variant in
                                                                  FILTER_VARIANTS[:1]] + [
        (16, variant, False) for variant in FILTER_VARIANTS] + [(16, FILTER_VARIANTS[0], True)]
} | {
    f"finish_mode{mode}_k{kp}": ("_finish_kernel", dict(picks_ptr="*i32", values_ptr="*bf16", visible_ptr="*i64",
                                                        blocks_ptr="*i32", out_ptr="*i32", width="i32", k="i32",
                                                        NB="i32", BS="i32"), dict(MODE=mode, K_P2=kp), 4)
    for mode in (0, 1, 2) for kp in (512, 2048)
} | {
    f"chunk_select_{bits}bit_first{first}_last{last}_k{kp}": (
        "_chunk_select_kernel", dict(keys_ptr=f"*i{bits if first else 32}", index_ptr="*i32", out_keys_ptr="*i32",
                                     out_index_ptr="*i32", width="i32", k="i32", out_width="i32"),
        dict(FIRST=first, LAST=last, KEY_BITS=bits if first else 32, CHUNK=4096, K_P2=kp), 4)  # CHUNK, CHUNK_WARPS
    for bits, first, last in ((16, True, True), (16, True, False), (32, True, False), (32, False, True),
                              (32, False, False)) for kp in (512, 2048)
} | {
    f"row_topk_{'radix_' if radix else ''}{bits}bit_mode{mode}_head{head}_tail{tail}_warps{warps}": (
        "_row_topk_kernel", dict(bits_ptr=f"*i{bits}", visible_ptr="*i64", blocks_ptr="*i32", out_ptr="*i32",
                                 width="i32", k="i32", NB="i32", BS="i32", NEG_INF="i32"),
        dict(MODE=mode, KEY_BITS=bits, HEAD=head, TAIL=tail, K_P2=512 if mode != 1 else 1024,
             NB_P2=2048 if mode == 2 else 16, RADIX=radix), warps)
    # as row_topk launches the 4K context's 515-, 2060- and 4120-wide rows (single_warps), as one tile and split,
    # and the other warps scripts/sweep_topk.py --single launches (but a 4096 tile on 16 warps: 16 bytes of stack
    # on sm_90, a sweep's point only); SINGLE_RADIX at those rows as launched split (and one 32-bit tile)
    for bits, mode, head, tail, warps, radix in [
        (bits, mode, head, tail, warps, False) for bits in (16, 32) for mode in (0, 1, 2)
        for head, tail, warps in ((1024, 0, 4), (4096, 0, 8), (8192, 0, 8), (8192, 0, 16), (512, 16, 4),
                                  (2048, 16, 4), (2048, 16, 8), (4096, 32, 8), (4096, 32, 16))] + [
        (16, 1, 512, 16, 4, True), (16, 0, 2048, 16, 4, True), (16, 2, 4096, 32, 8, True), (32, 2, 8192, 0, 8, True)]
}


@pytest.mark.parametrize("name", list(TOPK_KERNELS))
def test_topk_kernels_compile_for_hopper(name):
    """Every variant the op launches (and scripts/sweep_topk.py's filter variants) compiles for sm_90
    without spilling registers."""
    from dsflash_compile.custom_ops import topk_triton

    spec = TOPK_KERNELS[name]
    aligned = (("bits_ptr", "cand_ptr", "picks_ptr", "keys_ptr", "width", "seg_width")  # as launched
               if spec[0] == "_filter_kernel" else ())
    check_compiles_for_hopper(topk_triton, spec, aligned)


def test_select_topk_rejects_bad_input():
    pytest.importorskip("triton")
    from dsflash_compile.custom_ops.topk_triton import select_topk

    with pytest.raises(ValueError, match="k = 9"):
        select_topk(torch.zeros(2, 8), 9)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        select_topk(torch.zeros(2, 8, dtype=torch.float64), 2)


@pytest.mark.parametrize("rows,width,path,segments", [
    (1, 1 << 20, "radix", 0), (8, 131072, "radix", 0), (8, 524288, "segmented", 32), (64, 16384, "radix", 0),
    (64, 131072, "segmented", 8), (64, 524288, "segmented", 11), (256, 131072, "rowwise", 0),
    (4096, 524288, "filter", 0)])
def test_topk_path_on_an_h200(monkeypatch, rows, width, path, segments):
    """The shapes-only choice at the H200's 132 SMs: the segmented filter path for the decode shapes where the
    11-30 e sweep timed it faster than torch.topk and the row-wise path, at the segment counts it timed
    (8 x 512K at 32, 64 x 512K near its 10, 64 x 128K between its 5 and 10); more rows stay row-wise."""
    pytest.importorskip("triton")
    from dsflash_compile.custom_ops import topk_triton

    monkeypatch.setattr(topk_triton, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # (shapes only: nothing runs on it)
    assert topk_triton.topk_path(rows, width, 512, cuda) == path
    assert topk_triton.segment_plan(width, topk_triton.filter_segments(rows, width, 512, cuda))[0] == max(segments, 1)


@pytest.mark.parametrize("rows,width,single", [(1, 515, True), (1, 2060, True), (1, 4120, True), (64, 8192, True),
                                               (1, 8193, False), (256, 4120, False), (4096, 2060, False)])
def test_single_path_on_an_h200(monkeypatch, rows, width, single):
    """The ops finish on the single path where the radix split path would rank rows of at most SINGLE_WIDTH
    (decode at 4K: 2060 / 4120 wide, 515 blocks); wider rows, and rows enough to fill the GPU, keep theirs."""
    pytest.importorskip("triton")
    from dsflash_compile.custom_ops import topk_triton

    monkeypatch.setattr(topk_triton, "_num_sms", lambda device: 132)
    monkeypatch.setattr(topk_triton, "SINGLE_ON", True)
    assert topk_triton.single_fits(rows, width, min(512, width), torch.device("cuda")) == single
    monkeypatch.setattr(topk_triton, "SINGLE_ON", False)
    assert not topk_triton.single_fits(rows, width, min(512, width), torch.device("cuda"))


# ----------------------------------------------------------------------------------------------- CUDA

GPU_SHAPES = [(1, 2060), (1, 4120), (8, 8192), (1, 16384), (64, 16384), (1, 1 << 20), (8, 1 << 20), (64, 131072),
              (4096, 8192), (4096, 16384), (4096, 131072), (512, 524288)]


@requires_cuda
@pytest.mark.parametrize("rows,width", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_indices_cuda_equals_reference(monkeypatch, rows, width, dtype):
    """Release k = 512 on decode and prefill shapes: the registered CUDA op (Triton) picks exactly what
    the reference picks, with the single path on and off (it takes the narrow decode rows); bf16 rows this
    long hold many exact ties at the cut."""
    from dsflash_compile.custom_ops.topk import topk_indices_reference

    from dsflash_compile.custom_ops import topk_triton

    scores = make_scores(rows, width, dtype, device="cuda").view(1, rows, width)
    visible = make_visible(rows, width, 512, device="cuda").view(1, rows)
    ref = topk_indices_reference(scores, 512, visible)
    # the single path where it fits (decode's narrow rows; its row as one tile or, split, a head and a tail), else
    # the same path
    for single, split, radix in ((False, False, False), (True, False, False), (True, True, False),
                                 (True, False, True), (True, True, True)):
        monkeypatch.setattr(topk_triton, "SINGLE_ON", single)
        monkeypatch.setattr(topk_triton, "SINGLE_SPLIT", split)
        monkeypatch.setattr(topk_triton, "SINGLE_RADIX", radix)
        bad = (ops.topk_indices(scores, 512, visible) != ref).any(-1).sum().item()
        print(f"topk {rows}x{width} {dtype} single {single} split {split} radix {radix}: "
              f"{'PASS' if bad == 0 else 'FAIL'} ({bad} rows differ)")
        assert bad == 0


@requires_cuda
@pytest.mark.parametrize("radix", [False, True])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("layout", CANDIDATE_LAYOUTS)
@pytest.mark.parametrize("rows", [1, 8])
def test_single_path_cuda_candidates_equal_reference(monkeypatch, layout, rows, split, radix):
    """candidate_blocks (515 blocks of 8, topk_blocks 2048 and 256) and candidate_topk (k = 512 over 515 blocks)
    at the decode shapes of a 4K context, on the single path (its rows as one tile, or split: SINGLE_SPLIT; the
    k-th key by bisection or by digits: SINGLE_RADIX): the reference's ids exactly, each block layout."""
    from dsflash_compile.custom_ops import topk_triton
    from dsflash_compile.custom_ops.indexer import candidate_blocks_reference, candidate_topk_reference

    monkeypatch.setattr(topk_triton, "SINGLE_ON", True)
    monkeypatch.setattr(topk_triton, "SINGLE_SPLIT", split)
    monkeypatch.setattr(topk_triton, "SINGLE_RADIX", radix)
    scores = make_scores(rows, 4120, torch.bfloat16, device="cuda").view(1, rows, -1)
    visible = make_visible(rows, 4120, 512, device="cuda").view(1, rows)
    for kept in (2048, 256):
        assert torch.equal(ops.candidate_blocks(scores, visible, kept, 8),
                           candidate_blocks_reference(scores, visible, kept, 8)), kept
    compact, blocks = make_candidates(rows, 1000, 515, 8, layout)
    compact, blocks = compact.cuda(), blocks.cuda()
    assert topk_triton.single_fits(rows, compact.shape[-1], 512, compact.device)
    assert torch.equal(ops.candidate_topk(compact, blocks, 8, 512), candidate_topk_reference(compact, blocks, 8, 512))


@requires_cuda
@pytest.mark.parametrize("rows,width", [(4096, 16384), (64, 1 << 19), (300, 70000)])
def test_rowwise_radix_and_filter_paths_cuda_agree(rows, width):
    """The paths forced on many-row shapes (one and two row-wise stages, a ragged last chunk; the filter
    path at every launch the sweep compares, and segmented with 2, 5 and 64 segments asked): the reference's
    picks exactly, bf16 ties included."""
    from dsflash_compile.custom_ops import topk_triton
    from dsflash_compile.custom_ops.topk import topk_indices_reference

    scores = make_scores(rows, width, torch.bfloat16, device="cuda").view(1, rows, width)
    visible = make_visible(rows, width, 512, device="cuda").view(1, rows)
    ref = topk_indices_reference(scores, 512, visible)
    for name, kwargs in (("rowwise", dict(chunk=topk_triton.CHUNK)), ("radix", dict(block=topk_triton.BLOCK))):
        bad = (topk_triton.topk_indices_triton(scores, 512, visible, **kwargs) != ref).any(-1).sum().item()
        print(f"topk {name} {rows}x{width}: {'PASS' if bad == 0 else 'FAIL'} ({bad} rows differ)")
        assert bad == 0, name
    for variant in topk_triton.FILTER_VARIANTS:
        picks = topk_triton.select_filtered(scores.view(rows, width), 512, *variant)
        bad = (topk_triton.finish(picks, topk_triton.VISIBLE, visible=visible.view(rows)) != ref).any(-1).sum().item()
        print(f"topk filter {variant} {rows}x{width}: {'PASS' if bad == 0 else 'FAIL'} ({bad} rows differ)")
        assert bad == 0, variant
    for segments in (2, 5, 64):
        picks = topk_triton.select_filtered(scores.view(rows, width), 512, segments=segments)
        bad = (topk_triton.finish(picks, topk_triton.VISIBLE, visible=visible.view(rows)) != ref).any(-1).sum().item()
        print(f"topk segmented x{segments} {rows}x{width}: {'PASS' if bad == 0 else 'FAIL'} ({bad} rows differ)")
        assert bad == 0, segments


@requires_cuda
@pytest.mark.parametrize("rows,width,dtype", [(4096, 524288, torch.bfloat16), (4096, 16384, torch.float32)])
def test_filter_path_cuda_prefill_with_overflow(rows, width, dtype):
    """The filter path at the largest prefill shape and on fp32, with some rows periodic in its group
    layout (far more candidates than slots: exactly those rows take the radix fallback): the reference's
    picks exactly."""
    from dsflash_compile.custom_ops import topk_triton
    from dsflash_compile.custom_ops.topk import topk_indices_reference

    scores = make_scores(rows, width, dtype, device="cuda")
    periodic = [5, rows - 1]
    scores[periodic] = (torch.arange(width, device="cuda") % (topk_triton.GROUPS * topk_triton.SAMPLE)).to(dtype)
    visible = make_visible(rows, width, 512, device="cuda")
    flags = torch.zeros(rows, dtype=torch.int32, device="cuda")
    out = topk_triton.finish(topk_triton.select_filtered(scores, 512, flags=flags), topk_triton.VISIBLE,
                             visible=visible)
    ref = topk_indices_reference(scores, 512, visible)
    bad = (out != ref).any(-1).sum().item()
    print(f"topk filter {rows}x{width} {dtype}: {'PASS' if bad == 0 else 'FAIL'} ({bad} rows differ), "
          f"overflowed rows {flags.nonzero().flatten().tolist()}")
    assert bad == 0 and flags.nonzero().flatten().tolist() == periodic


@requires_cuda
@pytest.mark.parametrize("rows,width", [(4, 1 << 18), (8, 1 << 19), (64, 1 << 17)])
def test_topk_indices_cuda_graph_replay(rows, width):
    """No host sync, no data-dependent allocation: capture once, replay on new scores, same as eager (the
    decode shapes; 8 x 512K and 64 x 128K take the segmented path on an H200)."""
    from dsflash_compile.custom_ops import topk_triton

    scores = make_scores(rows, width, torch.bfloat16, device="cuda").view(1, rows, -1)
    visible = torch.full((1, rows), width, device="cuda")
    assert (topk_triton.topk_path(rows, width, 512, scores.device) == "segmented") == (rows > 4)
    ops.topk_indices(scores, 512, visible)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.topk_indices(scores, 512, visible)
    scores.copy_(make_scores(rows, width, torch.bfloat16, seed=5, device="cuda").view(1, rows, -1))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops.topk_indices(scores, 512, visible))
