"""The `dsflash` indexer, candidate and top-k ops (MODEL.md 4, 4.2) against plain formulations written here
(CPU). attention_ is tested in test_attention.py, record_write_ / record_read in test_records.py."""

import math

import pytest
import torch

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)

ops = torch.ops.dsflash
NEG_INF = -math.inf


def gen(seed):
    return torch.Generator().manual_seed(seed)


def ramp_visible(batch, seq, rows):
    """Ratio-like visibility: query t of row b sees (t + 1 + b) // 2 rows (0 for the first), capped at rows."""
    t = torch.arange(seq)
    return torch.stack([((t + 1 + b) // 2).clamp_max(rows) for b in range(batch)])


# ----------------------------------------------------------------------------------- indexer_scores


def indexer_inputs(seed, batch=2, seq=6, heads=8, dim=32, rows=20, num_rows=16):
    g = gen(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g).bfloat16()
    weights = (torch.randn(batch, seq, heads, generator=g) * (dim * heads) ** -0.5).bfloat16()
    keys = torch.randn(batch, rows, dim, generator=g).bfloat16()
    visible = (ramp_visible(batch, seq, num_rows) * 5).clamp_max(num_rows)
    visible[1, -1] = num_rows  # one query sees every row
    return q, weights, keys, visible, num_rows


def test_indexer_scores_opcheck():
    """opcheck with bf16 q/weights/keys, a key buffer longer than num_rows and zero-visible queries."""
    args = indexer_inputs(20)
    assert (args[3] == 0).any()
    torch.library.opcheck(ops.indexer_scores.default, args)


def test_indexer_scores_matches_fp32_formula():
    """I[b,t,j] = sum_h w * relu(q . k_j) (fp32 einsum) within bf16 tolerance on visible rows."""
    q, weights, keys, visible, num_rows = indexer_inputs(21)
    out = ops.indexer_scores(q, weights, keys, visible, num_rows)
    assert out.dtype == torch.bfloat16 and out.shape == (*q.shape[:2], num_rows)
    dots = torch.einsum("bshd,btd->bsht", q.float(), keys[:, :num_rows].float()).relu()
    expected = (dots * weights.float().unsqueeze(-1)).sum(dim=2)
    magnitude = (dots * weights.float().abs().unsqueeze(-1)).sum(dim=2)
    # bf16 rounding of each q.k, of each weighted term and of the head sum: a few 2^-8 of sum_h |w| relu(q.k)
    vis = torch.arange(num_rows) < visible.unsqueeze(-1)
    err = (out.float() - expected).abs()[vis]
    assert (err <= 4 * 2 ** -8 * magnitude[vis] + 1e-6).all()
    assert out[vis].isfinite().all()


def test_indexer_scores_hidden_rows_are_neg_inf():
    """Rows j >= visible[b, t] are -inf (a visible = 0 query gets an all -inf row); the rest are finite."""
    q, weights, keys, visible, num_rows = indexer_inputs(22)
    out = ops.indexer_scores(q, weights, keys, visible, num_rows)
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            v = int(visible[b, t])
            assert (out[b, t, v:] == NEG_INF).all()
            assert out[b, t, :v].isfinite().all()
    assert (visible == 0).any() and (out[visible == 0] == NEG_INF).all()


def test_indexer_scores_reads_only_num_rows_keys():
    """Keys past num_rows (here NaN) are never read: same result as a buffer cut at num_rows."""
    q, weights, keys, visible, num_rows = indexer_inputs(23)
    poisoned = keys.clone()
    poisoned[:, num_rows:] = float("nan")
    out = ops.indexer_scores(q, weights, poisoned, visible, num_rows)
    assert not out.isnan().any()
    assert torch.equal(out, ops.indexer_scores(q, weights, keys[:, :num_rows].contiguous(), visible, num_rows))


# ----------------------------------------------------------------------------------- candidate_mask


def tie_free_scores(seed, batch, seq, width, visible):
    """Distinct integer scores (exact in bf16 up to 256), -inf at rows j >= visible as the indexer gives."""
    g = gen(seed)
    scores = torch.stack([torch.randperm(width, generator=g) for _ in range(batch * seq)]).view(batch, seq, width)
    scores = (scores.float() - width / 2).bfloat16()
    return scores.masked_fill(torch.arange(width) >= visible.unsqueeze(-1), NEG_INF)


def plain_candidates(scores, visible, topk_blocks, block_size):
    batch, seq, width = scores.shape
    n_blocks = -(-width // block_size)
    keep = torch.zeros(batch, seq, width, dtype=torch.bool)
    for b in range(batch):
        for t in range(seq):
            block_max = [scores[b, t, i * block_size:(i + 1) * block_size].max().item() for i in range(n_blocks)]
            chosen = [] if visible[b, t] == 0 else [(int(visible[b, t]) - 1) // block_size]
            for i in sorted(range(n_blocks), key=lambda i: -block_max[i]):
                if len(chosen) < topk_blocks and i not in chosen and block_max[i] > NEG_INF:
                    chosen.append(i)
            for i in chosen:
                keep[b, t, i * block_size:(i + 1) * block_size] = True
    return keep


def kept_blocks(mask, block_size):
    return torch.nn.functional.pad(mask, (0, -mask.shape[-1] % block_size)).unflatten(-1, (-1, block_size)).any(-1)


def as_mask(blocks, block_size, width):
    """Block ids [..., nb] (-1 = none) -> the per-row mask [..., width] they cover."""
    from dsflash_compile.custom_ops.indexer import candidate_rows

    rows = candidate_rows(blocks, block_size)
    mask = torch.zeros(*rows.shape[:-1], width + 1, dtype=torch.bool)
    return mask.scatter_(-1, torch.where((rows >= 0) & (rows < width), rows, width), True)[..., :width]


@pytest.mark.parametrize("width", [48, 43])
def test_candidate_blocks_opcheck(width):
    """opcheck with bf16 scores holding -inf rows and zero-visible queries, width a multiple of the block or not."""
    batch, seq = 2, 6
    visible = ramp_visible(batch, seq, width) * 7
    scores = tie_free_scores(30, batch, seq, width, visible)
    torch.library.opcheck(ops.candidate_blocks.default, (scores, visible, 3, 4))


@pytest.mark.parametrize("topk_blocks", [1, 3, 20])
def test_candidate_blocks_match_plain_selection(topk_blocks):
    """Block max over blocks of block_size (last padded), newest block pinned, best topk_blocks finite blocks
    kept, published as ascending block ids with -1 after the last kept one."""
    batch, seq, width, block_size = 2, 6, 43, 4
    visible = (ramp_visible(batch, seq, width) * 7).clamp_max(width)
    scores = tie_free_scores(31, batch, seq, width, visible)
    out = ops.candidate_blocks(scores, visible, topk_blocks, block_size)
    assert out.dtype == torch.int32 and out.shape == (batch, seq, min(topk_blocks, 11))
    kept = torch.where(out >= 0, out, 1 << 20)
    assert torch.equal(kept, kept.sort(-1).values)  # ascending, -1 padding at the end
    assert torch.equal(as_mask(out, block_size, width), plain_candidates(scores, visible, topk_blocks, block_size))


def test_candidate_blocks_pin_newest_block_even_if_lowest():
    """The block holding row visible-1 is kept although its scores are the lowest."""
    width, block_size = 43, 4
    visible = torch.tensor([[22, 43]])
    scores = tie_free_scores(32, 1, 2, width, visible)
    scores[0, 0, 20:22] = -1000.0  # rows 20, 21: the newest block (5) holds only the lowest scores
    scores[0, 1, 40:43] = -1000.0  # the padded last block (10) is the newest and the lowest
    for topk_blocks in (1, 2):
        out = ops.candidate_blocks(scores, visible, topk_blocks, block_size)
        assert 5 in out[0, 0].tolist() and 10 in out[0, 1].tolist()
        assert (out >= 0).sum(-1).eq(topk_blocks).all()


def test_candidate_blocks_neg_inf_blocks_not_kept():
    """With fewer visible blocks than topk_blocks only the visible blocks are kept; visible = 0 keeps nothing."""
    width, block_size = 43, 4
    visible = torch.tensor([[5, 0, 1]])
    scores = tie_free_scores(33, 1, 3, width, visible)
    out = ops.candidate_blocks(scores, visible, 8, block_size)
    assert out[0, 0].tolist() == [0, 1] + [-1] * 6
    assert out[0, 1].tolist() == [-1] * 8
    assert out[0, 2].tolist() == [0] + [-1] * 7


def candidate_inputs(seed, fmt="bf16"):
    q, weights, keys, visible, num_rows = indexer_inputs(seed)
    dense = ops.indexer_scores(q, weights, keys, visible, num_rows)
    blocks = ops.candidate_blocks(dense, visible, 3, 4)
    return q, weights, keys, visible, num_rows, dense, blocks


def test_candidate_scores_equal_dense_scores_at_candidate_rows():
    """Candidate-only scores equal the dense scores gathered at the candidate rows (bit for bit: same bf16
    products and head sum), -inf where the block is -1 or the row is not visible; opcheck."""
    from dsflash_compile.custom_ops.indexer import candidate_rows

    q, weights, keys, visible, num_rows, dense, blocks = candidate_inputs(40)
    out = ops.candidate_scores(q, weights, keys[:, :num_rows], blocks, 4, visible, "bf16")
    rows = candidate_rows(blocks, 4)
    ok = (rows >= 0) & (rows < visible.unsqueeze(-1))
    expected = dense.gather(-1, rows.clamp(0, num_rows - 1)).masked_fill(~ok, NEG_INF)
    assert out.shape == rows.shape and torch.equal(out, expected)
    torch.library.opcheck(ops.candidate_scores.default, (q, weights, keys[:, :num_rows], blocks, 4, visible, "bf16"))


def test_candidate_scores_read_mxfp4_records():
    """MXFP4 key records give the scores of their decoded keys (the records are exact on that grid)."""
    from dsflash_compile.custom_ops import records

    q, weights, keys, visible, num_rows, dense, blocks = candidate_inputs(41)
    packed = records.encode_reference(keys, "mxfp4")
    decoded = records.decode_reference(packed, "mxfp4", keys.shape[-1])
    assert torch.equal(ops.candidate_scores(q, weights, packed, blocks, 4, visible, "mxfp4"),
                       ops.candidate_scores(q, weights, decoded, blocks, 4, visible, "bf16"))


def test_candidate_topk_equals_dense_topk_over_masked_scores():
    """Top-k in the compact space, remapped to rows, equals top-k over the dense scores masked to the
    candidates (tie-free), ascending; picks beyond the finite candidates are -1; opcheck."""
    batch, seq, width, block_size, k = 2, 6, 43, 4, 5
    visible = (ramp_visible(batch, seq, width) * 7).clamp_max(width)
    dense = tie_free_scores(42, batch, seq, width, visible)
    blocks = ops.candidate_blocks(dense, visible, 3, block_size)
    from dsflash_compile.custom_ops.indexer import candidate_rows

    rows = candidate_rows(blocks, block_size)
    ok = (rows >= 0) & (rows < visible.unsqueeze(-1))
    compact = dense.gather(-1, rows.clamp(0, width - 1)).masked_fill(~ok, NEG_INF)
    out = ops.candidate_topk(compact, blocks, block_size, k)
    masked = dense.masked_fill(~as_mask(blocks, block_size, width), NEG_INF)
    dense_picks = ops.topk_indices(masked, k, visible)
    for b in range(batch):
        for t in range(seq):
            expected = {x for x in dense_picks[b, t].tolist() if x >= 0 and masked[b, t, x].isfinite()}
            assert {x for x in out[b, t].tolist() if x >= 0} == expected, (b, t)
            assert out[b, t].tolist() == sorted(expected) + [-1] * (k - len(expected))
    assert out.dtype == torch.int32 and out.shape == (batch, seq, k)
    torch.library.opcheck(ops.candidate_topk.default, (compact, blocks, block_size, k))


# ------------------------------------------------------------------------------------- topk_indices


def test_topk_indices_opcheck():
    """opcheck with bf16 scores, -inf hidden rows and queries with fewer visible rows than k."""
    batch, seq, width = 2, 6, 24
    visible = ramp_visible(batch, seq, width) * 3
    scores = tie_free_scores(40, batch, seq, width, visible)
    torch.library.opcheck(ops.topk_indices.default, (scores, 8, visible))


def test_topk_indices_sorted_set_of_k_largest():
    """All rows visible: the picks are the k largest rows, sorted ascending, int32 of shape [B, S, k]."""
    batch, seq, width, k = 2, 5, 40, 7
    visible = torch.full((batch, seq), width)
    scores = tie_free_scores(41, batch, seq, width, visible)
    out = ops.topk_indices(scores, k, visible)
    assert out.dtype == torch.int32 and out.shape == (batch, seq, k)
    expected = scores.float().argsort(dim=-1, descending=True)[..., :k].sort(dim=-1).values
    assert torch.equal(out.long(), expected)


def test_topk_indices_fewer_visible_than_k():
    """With visible < k the picks are 0..visible-1 ascending, then -1 for the k - visible hidden picks."""
    batch, seq, width, k = 2, 6, 24, 8
    visible = ramp_visible(batch, seq, width) * 3
    scores = tie_free_scores(42, batch, seq, width, visible)
    out = ops.topk_indices(scores, k, visible)
    for b in range(batch):
        for t in range(seq):
            v = int(visible[b, t])
            if v < k:
                assert out[b, t].tolist() == list(range(v)) + [-1] * (k - v)
            else:
                assert (out[b, t] >= 0).all() and (out[b, t] < v).all()


def test_topk_indices_picks_past_visible_become_minus_one():
    """A pick j >= visible[b, t] becomes -1 even where its score is finite; visible picks stay, ascending."""
    batch, seq, width, k = 1, 4, 30, 6
    visible = torch.tensor([[0, 3, 12, 30]])
    scores = tie_free_scores(43, batch, seq, width, torch.full((batch, seq), width))  # no -inf anywhere
    out = ops.topk_indices(scores, k, visible)
    top = scores.float().argsort(dim=-1, descending=True)[..., :k].sort(dim=-1).values
    expected = torch.where(top < visible.unsqueeze(-1), top, -1)
    assert torch.equal(out.long(), expected)
    assert (out[0, 0] == -1).all()


def test_top_k_stable_breaks_ties_by_lower_index():
    """Exact ties (including +0/-0) go to the lower index; otherwise the k largest, like a stable sort."""
    from dsflash_compile.custom_ops.topk import top_k_stable

    scores = torch.tensor([[1.0, 3.0, 3.0, NEG_INF, 2.0, 3.0, -0.0, 0.0, -5.0, NEG_INF]]).bfloat16()
    values, indices = top_k_stable(scores, 10)
    assert indices[0].tolist() == [1, 2, 5, 4, 0, 6, 7, 8, 3, 9]
    assert torch.equal(values, scores.gather(-1, indices))
    y = torch.randn(3, 1000, generator=gen(7)).bfloat16()
    ref = y.float().sort(dim=-1, descending=True, stable=True)
    assert torch.equal(top_k_stable(y, 17)[1], ref.indices[:, :17])
