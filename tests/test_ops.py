"""The `dsflash` torch.library ops (MODEL.md 4, 4.2) against plain formulations written here (CPU)."""

import math

import pytest
import torch

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)

ops = torch.ops.dsflash
NEG_INF = -math.inf


def gen(seed):
    return torch.Generator().manual_seed(seed)


def pick_indices(g, batch, seq, n_keys, width, drop=0.25, dtype=torch.int64):
    """[batch, seq, width] distinct indices into n_keys rows, about `drop` of them set to -1."""
    idx = torch.stack([torch.randperm(n_keys, generator=g)[:width] for _ in range(batch * seq)])
    idx = idx.view(batch, seq, width)
    return idx.masked_fill(torch.rand(idx.shape, generator=g) < drop, -1).to(dtype)


def ramp_visible(batch, seq, rows):
    """Ratio-like visibility: query t of row b sees (t + 1 + b) // 2 rows (0 for the first), capped at rows."""
    t = torch.arange(seq)
    return torch.stack([((t + 1 + b) // 2).clamp_max(rows) for b in range(batch)])


# --------------------------------------------------------------------------------- sparse_attention


def attention_inputs(seed, batch=2, seq=5, heads=4, dim=64, n_window=16, n_comp=12, kw=8, kc=6,
                     idx_dtype=torch.int64):
    g = gen(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g).bfloat16()
    kv = torch.randn(batch, n_window, dim, generator=g).bfloat16()
    ckv = torch.randn(batch, n_comp, dim, generator=g).bfloat16()
    idx = pick_indices(g, batch, seq, n_window, kw, dtype=idx_dtype)
    cidx = pick_indices(g, batch, seq, n_comp, kc, dtype=idx_dtype)
    sink = torch.rand(heads, generator=g) * 3 - 1  # [-1, 2]: comparable to the keys' exp(s), so it matters
    return q, kv, idx, ckv, cidx, sink, dim ** -0.5


def plain_attention(q, kv, idx, ckv, cidx, sink, scale):
    """o = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h)) over the valid listed keys, in float64."""
    batch, seq, heads, dim = q.shape
    out = torch.zeros(batch, seq, heads, dim, dtype=torch.float64)
    sink = sink.double()
    for b in range(batch):
        for t in range(seq):
            w, c = idx[b, t].long(), cidx[b, t].long()
            keys = torch.cat([kv[b, w[w >= 0]], ckv[b, c[c >= 0]]]).double()
            if len(keys) == 0:
                continue
            s = q[b, t].double() @ keys.T * scale  # [H, K]
            m = torch.maximum(s.amax(-1), sink)
            e = torch.exp(s - m[:, None])
            out[b, t] = (e @ keys) / (e.sum(-1) + torch.exp(sink - m))[:, None]
    return out


def attention_atol(kv, ckv):
    # The op rounds each probability to bf16 before PV (relative error <= 2^-8) and rounds the output to
    # bf16 (relative error <= 2^-8 of |o| <= max|v|): |op - exact| <= 2^-7 max|v| ~ 0.0078 max|v| plus fp32 noise.
    return 1e-2 * max(kv.float().abs().max().item(), ckv.float().abs().max().item())


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_sparse_attention_opcheck(idx_dtype):
    """opcheck (schema, autograd registration, fake tensor, AOT dispatch) with bf16 q/kv and -1 indices."""
    args = attention_inputs(0, idx_dtype=idx_dtype)
    assert (args[2] == -1).any() and (args[4] == -1).any()
    torch.library.opcheck(ops.sparse_attention.default, args)


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_sparse_attention_matches_plain_formula(idx_dtype):
    """Output equals the sink-in-denominator softmax over the valid window + compressed keys."""
    args = attention_inputs(1, idx_dtype=idx_dtype)
    out = ops.sparse_attention(*args)
    expected = plain_attention(*args)
    atol = attention_atol(args[1], args[3])
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    # the sink must matter at this tolerance, or the comparison above would not test it
    without_sink = plain_attention(*args[:5], torch.full_like(args[5], NEG_INF), args[6])
    assert (without_sink - expected).abs().max() > 5 * atol


def test_sparse_attention_dtype_and_shape():
    """Output has q's dtype and shape [B, S, H, d], also with an empty compressed list (ratio-0 layer)."""
    q, kv, idx, ckv, cidx, sink, scale = attention_inputs(2)
    out = ops.sparse_attention(q, kv, idx, ckv, cidx, sink, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    no_comp = ops.sparse_attention(q, kv, idx, ckv[:, :0], cidx[:, :, :0], sink, scale)
    assert no_comp.dtype == torch.bfloat16 and no_comp.shape == q.shape
    torch.testing.assert_close(no_comp.double(), plain_attention(q, kv, idx, ckv[:, :0], cidx[:, :, :0], sink, scale),
                               atol=attention_atol(kv, kv), rtol=0)


def test_sparse_attention_all_invalid_query_is_zero():
    """A query whose every window and compressed index is -1 returns exactly zeros; the others are unaffected."""
    q, kv, idx, ckv, cidx, sink, scale = attention_inputs(3)
    idx2, cidx2 = idx.clone(), cidx.clone()
    idx2[1, 2] = -1
    cidx2[1, 2] = -1
    out = ops.sparse_attention(q, kv, idx2, ckv, cidx2, sink, scale)
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))
    assert out.isfinite().all()
    ref = ops.sparse_attention(q, kv, idx, ckv, cidx, sink, scale)
    others = torch.ones(out.shape[:2], dtype=torch.bool)
    others[1, 2] = False
    assert torch.equal(out[others], ref[others])


def test_sparse_attention_window_compressed_split_is_irrelevant():
    """Window + compressed lists equal one concatenated list, wherever the keys are split between kv and ckv."""
    q, kv, idx, ckv, cidx, sink, scale = attention_inputs(4, kw=10, kc=7)
    n_window = kv.shape[1]
    all_kv = torch.cat([kv, ckv], dim=1)
    all_idx = torch.cat([idx, torch.where(cidx >= 0, cidx + n_window, -1)], dim=-1)
    out = ops.sparse_attention(q, kv, idx, ckv, cidx, sink, scale)
    everything_window = ops.sparse_attention(q, all_kv, all_idx, all_kv[:, :0], all_idx[..., :0], sink, scale)
    everything_comp = ops.sparse_attention(q, all_kv[:, :0], all_idx[..., :0], all_kv, all_idx, sink, scale)
    moved = ops.sparse_attention(q, all_kv, all_idx[..., :3], all_kv, all_idx[..., 3:], sink, scale)
    for other in (everything_window, everything_comp, moved):
        assert torch.equal(other, out)


def test_sparse_attention_many_keys_online_softmax():
    """With more than 64 keys (several online-softmax blocks, running max rising) output still matches."""
    batch, seq, heads, dim, n_comp = 2, 3, 4, 64, 200
    q, kv, idx, ckv, cidx, sink, scale = attention_inputs(5, batch, seq, heads, dim, n_window=48, n_comp=n_comp,
                                                          kw=40, kc=150)
    # later compressed rows have larger norms and cidx lists them in ascending order, so the later
    # blocks hold the larger scores and the running max must be rescaled several times
    ckv = (ckv.float() * torch.linspace(0.5, 3.0, n_comp)[None, :, None]).bfloat16()
    cidx = torch.where(cidx >= 0, cidx, n_comp).sort(dim=-1).values
    cidx = cidx.masked_fill(cidx == n_comp, -1)
    assert ((idx >= 0).sum(-1) + (cidx >= 0).sum(-1)).min() > 2 * 64
    out = ops.sparse_attention(q, kv, idx, ckv, cidx, sink, scale)
    torch.testing.assert_close(out.double(), plain_attention(q, kv, idx, ckv, cidx, sink, scale),
                               atol=attention_atol(kv, ckv), rtol=0)


# ------------------------------------------------------------------------------------- cache_write_


def write_inputs(seed, cache_batch=3, batch=3, slots_n=10, seq=5, tail=(4,), dtype=torch.bfloat16,
                 rows_dtype=torch.bfloat16):
    g = gen(seed)
    cache = torch.randn(cache_batch, slots_n, *tail, generator=g).to(dtype)
    rows = torch.randn(batch, seq, *tail, generator=g).to(rows_dtype)
    slots = pick_indices(g, batch, 1, slots_n, seq).view(batch, seq)
    return cache, rows, slots


def plain_write(cache, rows, slots):
    out = cache.clone()
    for b in range(slots.shape[0]):
        for t in range(slots.shape[1]):
            if slots[b, t] >= 0:
                out[b, slots[b, t]] = rows[b, t].to(cache.dtype)
    return out


WRITE_CASES = {
    "bf16": dict(),
    "fp32-cache-bf16-rows": dict(dtype=torch.float32),
    "fp32-rows-bf16-cache": dict(rows_dtype=torch.float32),
    "partial-batch": dict(cache_batch=4, batch=2),
    "head-dims": dict(tail=(2, 8)),
}


@pytest.mark.parametrize("case", WRITE_CASES)
def test_cache_write_opcheck(case):
    """opcheck (schema check: only `cache` is mutated) on a fresh cache per case; the caller's cache is untouched."""
    cache, rows, slots = write_inputs(10, **WRITE_CASES[case])
    before = cache.clone()
    torch.library.opcheck(ops.cache_write_.default, (cache, rows, slots))
    # opcheck runs the op several times, each on deep copies of the arguments, so our cache is never written
    assert torch.equal(cache, before)


@pytest.mark.parametrize("case", WRITE_CASES)
def test_cache_write_rows_land_at_slots(case):
    """cache[b, slots[b, t]] = rows[b, t]; slot -1 skipped; every other slot and cache row untouched."""
    cache, rows, slots = write_inputs(11, **WRITE_CASES[case])
    assert (slots == -1).any()
    before = cache.clone()
    assert ops.cache_write_(cache, rows, slots) is None
    assert torch.equal(cache, plain_write(before, rows, slots))
    written = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for b, t in (slots >= 0).nonzero().tolist():
        written[b, slots[b, t]] = True
        assert torch.equal(cache[b, slots[b, t]], rows[b, t].to(cache.dtype))
    assert torch.equal(cache[~written], before[~written])


def test_cache_write_partial_batch_touches_first_rows_only():
    """rows with B < cache batch write only cache rows 0..B-1."""
    cache, rows, slots = write_inputs(12, cache_batch=5, batch=2)
    before = cache.clone()
    ops.cache_write_(cache, rows, slots)
    assert torch.equal(cache[2:], before[2:])
    assert not torch.equal(cache[:2], before[:2])


def test_cache_write_all_skipped_is_noop():
    """slots all -1 leave the cache bit-identical."""
    cache, rows, slots = write_inputs(13)
    before = cache.clone()
    ops.cache_write_(cache, rows, torch.full_like(slots, -1))
    assert torch.equal(cache, before)


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


@pytest.mark.parametrize("width", [48, 43])
def test_candidate_mask_opcheck(width):
    """opcheck with bf16 scores holding -inf rows and zero-visible queries, width a multiple of the block or not."""
    batch, seq = 2, 6
    visible = ramp_visible(batch, seq, width) * 7
    scores = tie_free_scores(30, batch, seq, width, visible)
    torch.library.opcheck(ops.candidate_mask.default, (scores, visible, 3, 4))


@pytest.mark.parametrize("topk_blocks", [1, 3, 20])
def test_candidate_mask_matches_plain_selection(topk_blocks):
    """Block max over blocks of block_size (last padded), newest block pinned, best topk_blocks finite blocks kept."""
    batch, seq, width, block_size = 2, 6, 43, 4
    visible = (ramp_visible(batch, seq, width) * 7).clamp_max(width)
    scores = tie_free_scores(31, batch, seq, width, visible)
    out = ops.candidate_mask(scores, visible, topk_blocks, block_size)
    assert out.dtype == torch.bool and out.shape == scores.shape
    assert torch.equal(out, plain_candidates(scores, visible, topk_blocks, block_size))
    assert (kept_blocks(out, block_size).sum(-1) <= topk_blocks).all()


def test_candidate_mask_pins_newest_block_even_if_lowest():
    """The block holding row visible-1 is kept although its scores are the lowest."""
    width, block_size = 43, 4
    visible = torch.tensor([[22, 43]])
    scores = tie_free_scores(32, 1, 2, width, visible)
    scores[0, 0, 20:22] = -1000.0  # rows 20, 21: the newest block (5) holds only the lowest scores
    scores[0, 1, 40:43] = -1000.0  # the padded last block (10) is the newest and the lowest
    for topk_blocks in (1, 2):
        out = ops.candidate_mask(scores, visible, topk_blocks, block_size)
        blocks = kept_blocks(out, block_size)
        assert blocks[0, 0, 5] and blocks[0, 1, 10]
        assert (blocks.sum(-1) == topk_blocks).all()
        assert out[0, 1, 40:].all()  # the last block covers the 3 real columns of the padded block


def test_candidate_mask_neg_inf_blocks_not_kept():
    """With fewer visible blocks than topk_blocks only the visible blocks are kept; visible = 0 keeps nothing."""
    width, block_size = 43, 4
    visible = torch.tensor([[5, 0, 1]])
    scores = tie_free_scores(33, 1, 3, width, visible)
    out = ops.candidate_mask(scores, visible, 8, block_size)
    assert out[0, 0].tolist() == [True] * 8 + [False] * (width - 8)  # blocks 0 and 1 (rows 4..7, row 4 visible)
    assert not out[0, 1].any()
    assert out[0, 2].tolist() == [True] * 4 + [False] * (width - 4)


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
