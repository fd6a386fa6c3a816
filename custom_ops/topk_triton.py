"""Triton top-k of the indexer: radix select on order-preserving keys, for `dsflash::topk_indices` and the
picks inside `candidate_blocks` and `candidate_topk` (CUDA).

Per row it picks the k largest entries, an exact tie going to the lower index: top_k_stable's result. A
score's bits become an integer key of the same order (a negative float maps to minus its magnitude bits,
so -0 ties +0, as in top_k_stable). The k-th largest key T is found 8 bits at a time, most significant
first: pass p histograms digit p of the entries whose higher digits equal T's so far, and T's digit is
read off the suffix sums (16-bit scores such as the indexer's bf16 need 2 passes, fp32 4). A compaction
pass then writes the index of every entry above T (slot from a per-row atomic counter: any order) and of
the first k - #above entries equal to T in index order (slot from the tie counts of the programs before
it, which the last pass stored per program). A finishing kernel sorts each row's k picks ascending and
maps them to the op's output. torch.topk sorts far more than it needs to; this reads each score 3 times
(bf16) and sorts only k entries.

A long row is split over several programs (SPLIT, from the shapes only) that merge their histograms
with atomics, so one 1M-entry row still fills the GPU. Buffer sizes depend on shapes only and nothing is
read back to the host: CUDA-graph safe.

Row-wise path (many rows: prefill chunks, 4096 x 16K..512K; 64 x 512K). The radix passes above cost
about 95 instructions per entry and pass in tl.histogram (8 ballots and a popcount per bin a thread
owns), and with one row per program nothing is gained from their atomics. Instead one program takes one
CHUNK (16384) entries of one row into registers and finds the chunk's k-th largest key T by bisection
on its bits (16 or 32 steps of compare + block sum, ~2 instructions per entry and step, no re-read),
then writes its k best in index order: every entry above T and the first k - #above entries equal to T
(exclusive cumsums, no atomics). A row of at most CHUNK entries is done in one pass over memory; a wider
row leaves k candidates per chunk (key, index) in chunk order, so a candidate's position orders like its
index, and the same kernel ranks the candidates again until one chunk remains (512K entries: 32 x 512
= 16K candidates, 2 launches; the global top k with ties to the lower index is always among the chunks'
own top k under the same order). A chunk with fewer than k entries pads its slots with key 0, below every
real key, never picked. Picks come out ascending; the finishing kernel maps them as before. Chosen when
rows x chunks fills the GPU (>= one program per SM) and k <= CHUNK / 2 (each stage must shrink the row);
the radix split path stays for few rows (decode), where it spreads one row over many programs.

Filter path (many rows wider than one chunk: prefill, 4096 x 8K..512K). The row-wise path ranks every
entry 16 times (its bisection); this one ranks only a few candidates per row, one program per row. Pass 1
reads a sample of the row (one 128-byte LINE in SAMPLE, the line rotating from one GROUPS * SAMPLE span to
the next so that no region of the row is skipped) into GROUPS running maxima, each group a disjoint set
of entries, and takes T = the k-th largest of the maxima. Guarantee: k groups have a maximum >= T, and
those are k distinct entries of the row, so the row's k-th largest key is >= T (T is a valid cut for any
data; a poor T only costs candidates). Pass 2 reads the whole row and stores, in index order, the index
of every entry above T (up to CAND - K_P2 of them) and of the first k equal to T (ties beyond those can
never be picked: ties go to the lower index). The candidates hold the row's top k, so the program ranks
them (bisection over CAND keys read back by index) and writes its k best. For iid scores ~575 entries
per row pass T at the default SAMPLE 1 (~1.1k with 2, ~2.3k with 4; simulated, 8K..512K wide), against
CAND - K_P2 = 1536 slots at k = 512 (filter_fits: k <= CAND / 4, so k = 512 at most). A row with
more than CAND - K_P2 keys above T (adversarial data, e.g. a period of the group layout) is flagged, and
the radix path, launched for every row but returning at once where no flag is set, redoes it: exact for
every input, fast for most. Cost: 1 + 1/SAMPLE reads of the scores; on sm_90 pass 1 issues ~9
instructions per sampled entry, pass 2 ~46 per entry (most of them Triton's layout conversion for the
scattered store, and predicates), plus two 16-step bisections per row (GROUPS maxima, CAND candidates).

Segmented filter path (fewer rows, wide: decode 64 x 128K..512K, 8 x 512K, where one program per row
leaves most SMs idle and the row-wise path ranks every entry 16 times): each row in segments of at least
SEGMENT entries, one filter program per (row, segment) with its own threshold, which writes the segment's
k best as (key, index) pairs in candidate order (equal keys in index order); the row-wise stages then rank
the row's segments x k pairs. The row's top k holds only entries of their segments' top k, so nothing is
lost; an overflowing segment flags its row for the radix fallback as above.

Single path (few rows of at most SINGLE_WIDTH entries: decode's dense and candidate rows at short contexts,
2060 / 4120 wide at 4K, and layer one's 515 blocks). The radix split path is 5 launches there (the counters'
fill, 2 histogram passes, compaction, the finish's sort: ~14 us of a B1 step's path each on the H200, 9 a
step). One program per row ranks the whole row in registers as a row-wise chunk does and writes the finished
picks itself: they come out in index order, which every mapping keeps (picks past visible, -inf picks and
-1 blocks fall at the end), so no sort; candidate_topk sorts only a row whose blocks are not ascending.
"""

import torch
import triton
import triton.language as tl

from .attention_triton import _num_sms
from .pdl import launch_options, pdl_wait

BLOCK = 4096  # entries per tile of a pass
SMALL_BLOCK = 1024  # the tile when all rows together are small (decode): more programs per row
PROGRAMS_PER_SM = 4
# row-wise path: entries of a row one program ranks in registers, and its warps (32 keys per thread). The
# H200 sweep (scripts/sweep_topk.py, 11-30; 4096 rows x 8K / 16K / 128K) was fastest at 4096 x 4 warps in
# all three: 0.35 / 0.68 / 5.8 ms against 16384 x 16 warps' - / 0.93 / 6.7 ms, although 32 keys per thread
# take ~200 registers (one program per SM) on the sm_90 build
CHUNK = 4096
CHUNK_WARPS = 4
FIT_CHUNK = 16384  # rowwise_fits counts programs in chunks this wide (the rule the 11-30 bench measured)
# filter path (many rows; see the module docstring): running maxima per row, pass 1 reading one LINE of
# entries in SAMPLE, candidate slots per row, tile of both passes, warps. The H200 sweep (scripts/sweep_topk.py,
# 11-30 b) was fastest at SAMPLE 1, CAND 2048, tile 2048, 4 warps: 4096 rows x 16K / 128K in 0.32 / 1.85 ms,
# 2.0 / 2.1x torch.topk, the row-wise path 0.95 / 0.69x; no row overflowed. At 64 and 8 rows it ties the
# row-wise path or loses (one program per row leaves SMs idle): FILTER_ROWS_PER_SM keeps those off it
GROUPS = 2048
SAMPLE = 1
CAND = 2048
FILTER_BLOCK = 2048
FILTER_WARPS = 4
FILTER_ROWS_PER_SM = 2
FILTER_ON = True  # False: select_topk never picks the filter path (row-wise or radix by shape)
# segmented filter path (fewer rows, wide: decode 64 x 128K..512K, 8 x 512K; see the module docstring): the
# fewest entries per segment, the (row, segment) programs per SM it aims for, and whether select_topk picks it.
# The H200 sweep (scripts/sweep_topk.py, 11-30 e), ms against torch.topk's, by segments per row:
#   64 x 512K: 0.353 / 0.294 / 0.238 at 2 / 5 / 10 (torch 0.321; the row-wise path 0.387)
#   8 x 512K:  0.062 / 0.053 / 0.068 at 16 / 32 / 64 (torch 0.082; row-wise 0.068)
#   64 x 128K: 0.074 / 0.083 / 0.096 at 2 / 5 / 10 (torch 0.119; row-wise 0.100)
# 5 programs per SM gives 32 segments at 8 x 512K (timed) and 11 / 8 at 64 x 512K / 128K (untimed; their
# timed neighbours beat torch.topk and the row-wise path, though 2 segments is ~20% faster at 64 x 128K).
# Only 8 and 64 rows were timed: more rows than SEGMENT_MAX_ROWS keep the row-wise path until a sweep times them
SEGMENT = 16384
SEGMENT_PROGRAMS_PER_SM = 5
SEGMENT_MAX_ROWS = 64
SEGMENTED_ON = True
LINE = tl.constexpr(64)  # 128 bytes of bf16 scores
# (GROUPS, SAMPLE, CAND, FILTER_BLOCK, FILTER_WARPS) launches scripts/sweep_topk.py compares, the defaults first
FILTER_VARIANTS = [(GROUPS, SAMPLE, CAND, FILTER_BLOCK, FILTER_WARPS), (2048, 2, 4096, 4096, 8),
                   (2048, 1, 2048, 4096, 8), (2048, 2, 4096, 2048, 8), (2048, 4, 4096, 4096, 8),
                   (1024, 2, 4096, 2048, 8), (2048, 2, 4096, 2048, 4), (2048, 2, 4096, 4096, 16)]
# single path (decode: one program per row of at most SINGLE_WIDTH entries, the finish in the same launch; see
# the module docstring), its keys per thread (warps from the row's width), and whether the ops take it: on. H200 B1
# step (12-05 f1, with the ring writes, the compressors' GEMV and engram-op as variant e-all) 10.212 ms against
# 10.389 without the four, each of 5 rounds lower, logits bit-equal; its CUDA tests passed (variant no-single-topk)
SINGLE_WIDTH = 8192
# Its warps: at most SINGLE_MAX_WARPS. H200, the B1 rows at a 4K context alone (sweep_topk.py --single, 12-05 g1):
# 4120 wide 13.63 us at 8 warps against 15.64 at 16, 2060 wide 8.66 at 8 against 9.49 at 4. (A bisection of 2 bits
# a block sum, three counts packed in one int64 sum, was slower but on the 515-wide row: 17.09 / 9.07 / 4.41 us
# against 15.64 / 8.66 / 4.67 at 16 keys a thread; removed.) In the step (12-05 g2, variant g-all with engram-op and
# the attention's prefetch) no difference beyond noise: back to back 9.988 ms, as engram-op alone. On: 8
SINGLE_KEYS_PER_THREAD = 16
SINGLE_MAX_WARPS = 8
SINGLE_ON = True
# Its row as a power-of-two head and a short tail (single_parts) rather than one tile of the next power of two: the
# 4K context's 4120- and 2060-wide rows were ranked as 8192 and 4096 entries, and the kernel's time grows with its
# tile (H200, 12-05 g1 sweep: 4.67 / 8.66 / 13.63 us at 1024 / 4096 / 8192; in the B1 step's trace, 12-05 g3, the five
# 4120-wide rows took ~17 us of the path each, 85 of the step's 117 in top-k). Same picks. H100, B1 side by side
# (12-05 k1, variant single-split): 12907 us waited against 12949, back to back 12874 against 12898. On
SINGLE_SPLIT = True
# Its k-th largest key by 8-bit digits, a histogram each (tl.histogram, over the keys that share the digits found so
# far: 2 for bf16 scores), where the bisection takes one block sum a bit (16): fewer barriers on the row's path. Same
# picks. Off: not measured yet (12-05 i: no GPU; sweep_topk.py --single times it, variant single-radix)
SINGLE_RADIX = False
_KEY_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}
KEY_DTYPES = tuple(_KEY_BITS)  # score dtypes the kernels rank
_BITS_VIEW = {16: torch.int16, 32: torch.int32}
# -inf's bits, sign-extended as the kernels load them
_NEG_INF_BITS = {dtype: torch.tensor(float("-inf"), dtype=dtype).view(_BITS_VIEW[bits]).item()
                 for dtype, bits in _KEY_BITS.items()}
# finishing modes: what a pick becomes (constexpr: the kernel reads them)
VISIBLE, FINITE, CANDIDATE_ROWS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _ordered(bits, KEY_BITS: tl.constexpr):
    """Sign-extended float bits (int32) -> a key with the float's order (-0 and +0 equal)."""
    return tl.where(bits < 0, -(bits & ((1 << (KEY_BITS - 1)) - 1)), bits)


@triton.jit
def _tile_keys(bits_ptr, row, width, off, end, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr):
    """Entries off .. off + BLOCK - 1 of a row: (index, present: index < end, ordered key)."""
    idx = off + tl.arange(0, BLOCK)
    live = idx < end
    bits = tl.load(bits_ptr + row.to(tl.int64) * width + idx, mask=live, other=0).to(tl.int32)
    return idx, live, _ordered(bits, KEY_BITS)


@triton.jit
def _unsigned_key(bits, live, KEY_BITS: tl.constexpr):
    """Sign-extended score bits -> uint32 key of the score's order: >= 1 where live, 0 where not."""
    key = _ordered(bits, KEY_BITS)
    if KEY_BITS == 32:  # signed order -> unsigned order
        u = (key ^ -2147483648).to(tl.uint32, bitcast=True)
    else:
        u = (key + 32768).to(tl.uint32)
    return tl.where(live, u, 0)


@triton.jit
def _kth_largest(u, k, KEY_BITS: tl.constexpr, u_tail=None, TAIL: tl.constexpr = False, RADIX: tl.constexpr = False):
    """The largest t with #(u >= t) >= k by bisection on its bits, one block sum per bit (0 if fewer than
    k keys are >= 1). TAIL: the row is u then u_tail, and the sums count both. RADIX: by digits instead
    (_kth_largest_radix)."""
    if RADIX:
        t = _kth_largest_radix(u, k, KEY_BITS, u_tail, TAIL)
    else:
        t = tl.zeros((), tl.uint32)
        for b in tl.static_range(KEY_BITS):
            cand = t | (1 << (KEY_BITS - 1 - b))
            count = tl.sum((u >= cand).to(tl.int32))
            if TAIL:
                count += tl.sum((u_tail >= cand).to(tl.int32))
            t = tl.where(count >= k, cand, t)
    return t


@triton.jit
def _kth_largest_radix(u, k, KEY_BITS: tl.constexpr, u_tail=None, TAIL: tl.constexpr = False):
    """_kth_largest by 8-bit digits, most significant first: a histogram of the digit over the keys that share the
    digits found so far, and the largest digit whose count from the top reaches what is still needed (KEY_BITS / 8
    histograms in place of KEY_BITS block sums; every key counts, 0s too, so t is 0 where fewer than k are >= 1)."""
    t = tl.zeros((), tl.uint32)
    need = k
    for p in tl.static_range(KEY_BITS // 8):
        h = _digit_histogram(u, t, p, KEY_BITS)
        if TAIL:
            h += _digit_histogram(u_tail, t, p, KEY_BITS)
        digit, need = _digit_reaching(h, need)
        t = t | (digit.to(tl.uint32) << (KEY_BITS - 8 * (p + 1)))
    return t


@triton.jit
def _digit_reaching(h, need):
    """From a digit's histogram h [256] over the keys still in the race: the largest digit whose count from the top
    reaches `need` (0 where none does), and what is still needed among the keys with that digit."""
    bins = tl.arange(0, 256)
    above = tl.sum(h) - tl.cumsum(h)  # keys whose digit is larger than each bin's
    digit = tl.maximum(tl.max(tl.where(above + h >= need, bins, -1)), 0)
    return digit, need - tl.sum(tl.where(bins > digit, h, 0))


@triton.jit
def _digit_histogram(u, t, p: tl.constexpr, KEY_BITS: tl.constexpr):
    """Counts of digit p (8 bits, most significant first) over the keys u whose higher digits are t's."""
    shift: tl.constexpr = KEY_BITS - 8 * (p + 1)
    digit = ((u >> shift) & 255).to(tl.int32)
    if p == 0:
        return tl.histogram(digit, 256)
    else:
        return tl.histogram(digit, 256, mask=(u >> (shift + 8)) == (t >> (shift + 8)))


@triton.jit
def _take(u, live, k, KEY_BITS: tl.constexpr, RADIX: tl.constexpr = False):
    """0/1 (int32): the k best of the unsigned keys u, every key above the k-th largest and the first
    (by position) of those equal to it."""
    return _take_at(u, live, _kth_largest(u, k, KEY_BITS, RADIX=RADIX), k, 0)


@triton.jit
def _take_at(u, live, t, need, before):
    """_take's picks of one part given the k-th largest key t: its keys above t, and its ties (keys equal to t) while
    fewer than `need` less its keys above t rank before them (`need`: k less the other part's keys above t;
    `before`: the other part's ties that rank first)."""
    above = (u > t).to(tl.int32)
    tie = (live & (u == t)).to(tl.int32)
    need -= tl.sum(above) + before
    return above | (tie & ((tl.cumsum(tie) - tie) < need).to(tl.int32))


@triton.jit
def _take_parts(u, live, u_tail, live_tail, k, KEY_BITS: tl.constexpr, RADIX: tl.constexpr = False):
    """_take over a row held as two parts, the head u then the tail u_tail: (take, take_tail). The bisection's
    block sums add both parts' counts; a tie's rank counts the head's ties before the tail's."""
    t = _kth_largest(u, k, KEY_BITS, u_tail, True, RADIX)
    need_head = k - tl.sum((u_tail > t).to(tl.int32))  # k less the tail's keys above t (_take_at takes the head's)
    need_tail = k - tl.sum((u > t).to(tl.int32))
    return (_take_at(u, live, t, need_head, 0),
            _take_at(u_tail, live_tail, t, need_tail, tl.sum((live & (u == t)).to(tl.int32))))


@triton.jit
def _digit(key, p: tl.constexpr, KEY_BITS: tl.constexpr):
    """Digit p (8 bits, most significant first) of the key read as unsigned (key + 2^(KEY_BITS-1))."""
    shift: tl.constexpr = KEY_BITS - 8 * (p + 1)
    if p == 0:
        return (key >> shift) + 128
    else:
        return (key >> shift) & 255


@triton.jit
def _threshold(hist_ptr, row, k, PASSES: tl.constexpr, NPASS: tl.constexpr, KEY_BITS: tl.constexpr):
    """The top PASSES digits of the k-th largest key (as a key with the lower bits 0) and how many of the
    k picks have exactly those top digits, from the merged histograms of passes 0..PASSES-1."""
    bins = tl.arange(0, 256)
    prefix = 0  # (set by pass 0: PASSES >= 1)
    need = k
    for p in tl.static_range(PASSES):
        h = tl.load(hist_ptr + (row.to(tl.int64) * NPASS + p) * 256 + bins)
        digit, need = _digit_reaching(h, need)
        if p == 0:
            prefix = (digit - 128) << (KEY_BITS - 8)
        else:
            prefix = prefix | (digit << (KEY_BITS - 8 * (p + 1)))
    return prefix, need


@triton.jit
def _histogram_kernel(bits_ptr, hist_ptr, ties_ptr, flags_ptr, width, chunk, k, SPLIT, P: tl.constexpr,
                      NPASS: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr, FLAGGED: tl.constexpr,
                      PDL: tl.constexpr):
    """Pass P: histogram of digit P over this program's chunk of the row, among the entries that match
    the threshold's top P digits; merged per row with atomics (the last pass also keeps its own).
    FLAGGED: only rows whose flag is set (the filter path's overflows); the others return at once."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    row = tl.program_id(0)
    split = tl.program_id(1)
    if FLAGGED:
        if tl.load(flags_ptr + row) == 0:
            return
    top: tl.constexpr = KEY_BITS - 8 * P  # bits below the matched prefix
    if P > 0:
        prefix, _ = _threshold(hist_ptr, row, k, P, NPASS, KEY_BITS)
    counts = tl.zeros((256,), tl.int32)
    start = split * chunk
    end = tl.minimum(start + chunk, width)
    for off in range(start, end, BLOCK):
        idx, live, key = _tile_keys(bits_ptr, row, width, off, end, BLOCK, KEY_BITS)
        if P > 0:
            live = live & ((key >> top) == (prefix >> top))
        counts += tl.histogram(_digit(key, P, KEY_BITS), 256, mask=live)
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_ptr + (row.to(tl.int64) * NPASS + P) * 256 + bins, counts)
    if P == NPASS - 1:
        tl.store(ties_ptr + (row.to(tl.int64) * SPLIT + split) * 256 + bins, counts)


@triton.jit
def _compact_kernel(bits_ptr, hist_ptr, ties_ptr, count_ptr, picks_ptr, flags_ptr, width, chunk, k, SPLIT,
                    NPASS: tl.constexpr, KEY_BITS: tl.constexpr, SPLIT_P2: tl.constexpr, BLOCK: tl.constexpr,
                    FLAGGED: tl.constexpr, PDL: tl.constexpr):
    """Write the indices of this chunk's entries above the threshold and of its share of the ties
    (FLAGGED: as in _histogram_kernel)."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    row = tl.program_id(0)
    split = tl.program_id(1)
    if FLAGGED:
        if tl.load(flags_ptr + row) == 0:
            return
    threshold, need = _threshold(hist_ptr, row, k, NPASS, NPASS, KEY_BITS)
    # ties before this chunk: the last pass's own counts of the programs before it, at T's last digit
    before = tl.arange(0, SPLIT_P2)
    tie_base = tl.sum(tl.load(ties_ptr + (row.to(tl.int64) * SPLIT + before) * 256 + (threshold & 255),
                              mask=before < split, other=0))
    first_tie = k - need  # ties take the slots after the entries above T
    out = picks_ptr + row.to(tl.int64) * k
    start = split * chunk
    end = tl.minimum(start + chunk, width)
    for off in range(start, end, BLOCK):
        idx, live, key = _tile_keys(bits_ptr, row, width, off, end, BLOCK, KEY_BITS)
        above = (live & (key > threshold)).to(tl.int32)
        n_above = tl.sum(above)
        if n_above > 0:
            slot = tl.atomic_add(count_ptr + row, n_above) + tl.cumsum(above) - 1
            tl.store(out + slot, idx, mask=above > 0)
        tie = (live & (key == threshold)).to(tl.int32)
        rank = tie_base + tl.cumsum(tie) - 1  # among the row's ties, in index order
        tl.store(out + first_tie + rank, idx, mask=(tie > 0) & (rank < need))
        tie_base += tl.sum(tie)


@triton.jit
def _chunk_select_kernel(keys_ptr, index_ptr, out_keys_ptr, out_index_ptr, width, k, out_width,
                         FIRST: tl.constexpr, LAST: tl.constexpr, KEY_BITS: tl.constexpr, CHUNK: tl.constexpr,
                         K_P2: tl.constexpr, PDL: tl.constexpr):
    """Row-wise path, one (row, chunk of CHUNK entries) per program. FIRST: the entries are score bits
    (index = position); else unsigned keys (int32 bits) and their indices from the previous stage. Writes
    the chunk's k best in index order: LAST: the indices to out_index [rows, k]; else (key, index) pairs to
    slots chunk * k .. of out_keys / out_index [rows, out_width], padded with key 0."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    pos = chunk * CHUNK + tl.arange(0, CHUNK)
    live = pos < width
    src = row.to(tl.int64) * width + pos
    if FIRST:
        u = _unsigned_key(tl.load(keys_ptr + src, mask=live, other=0).to(tl.int32), live, KEY_BITS)
        idx = pos
    else:
        u = tl.load(keys_ptr + src, mask=live, other=0).to(tl.uint32, bitcast=True)
        idx = tl.load(index_ptr + src, mask=live, other=0)
    take = _take(u, live, k, KEY_BITS)
    slot = tl.cumsum(take) - 1  # index order
    if LAST:
        tl.store(out_index_ptr + row.to(tl.int64) * k + slot, idx, mask=take > 0)
    else:
        base = row.to(tl.int64) * out_width + chunk * k
        tl.store(out_index_ptr + base + slot, idx, mask=take > 0)
        tl.store(out_keys_ptr + base + slot, u.to(tl.int32, bitcast=True), mask=take > 0)
        s = tl.arange(0, K_P2)
        pad = (s >= tl.sum(take)) & (s < k)
        tl.store(out_keys_ptr + base + s, tl.zeros((K_P2,), tl.int32), mask=pad)
        tl.store(out_index_ptr + base + s, tl.zeros((K_P2,), tl.int32), mask=pad)


@triton.jit
def _filter_kernel(bits_ptr, cand_ptr, picks_ptr, keys_ptr, flags_ptr, width, seg_width, k, KEY_BITS: tl.constexpr,
                   GROUPS: tl.constexpr, SAMPLE: tl.constexpr, CAND: tl.constexpr, K_P2: tl.constexpr,
                   BLOCK: tl.constexpr, SEGMENTED: tl.constexpr, PDL: tl.constexpr):
    """Filter path, one (row, segment of seg_width entries) per program (see the module docstring): a
    threshold T <= the segment's k-th largest key from group maxima of a sample, the candidates' indices
    (keys above T, the first k equal to it) to cand [rows x segments, CAND], their k best to picks. Not
    SEGMENTED (one segment, seg_width = width): picks [rows, k] (indices in no order), flags[row] = 1 where
    the keys above T overflow their CAND - K_P2 slots (picks not written: the radix path redoes the row).
    SEGMENTED: the k best (index, key) pairs in candidate order to picks / keys [rows, segments x k], slots
    segment x k .. (padded with key 0, below every real key), for the row-wise stages; an overflow sets
    flags[row] (zeroed beforehand)."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    row = tl.program_id(0)
    if SEGMENTED:
        start = tl.program_id(1) * seg_width
        length = tl.minimum(width - start, seg_width)
        program = row.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    else:  # (the unsegmented kernel as the sweep timed it: no segment arithmetic, no extra registers)
        start = 0
        length = width
        program = row.to(tl.int64)
    src = bits_ptr + row.to(tl.int64) * width + start
    # pass 1: matrix row m (SPAN entries) gives group g the entry at column LINE * (g // LINE * SAMPLE +
    # m % SAMPLE) + g % LINE: one LINE in SAMPLE, the line rotating with m, every entry in one group at most
    SPAN: tl.constexpr = GROUPS * SAMPLE
    TILE_ROWS: tl.constexpr = BLOCK // GROUPS
    g = tl.arange(0, GROUPS)[None, :]
    column = g // LINE * SAMPLE * LINE + g % LINE
    maxima = tl.zeros((GROUPS,), tl.uint32)
    for m0 in range(0, tl.cdiv(length, SPAN), TILE_ROWS):
        m = m0 + tl.arange(0, TILE_ROWS)[:, None]
        idx = m * SPAN + m % SAMPLE * LINE + column
        live = idx < length
        u = _unsigned_key(tl.load(src + idx, mask=live, other=0).to(tl.int32), live, KEY_BITS)
        maxima = tl.maximum(maxima, tl.max(u, axis=0))
    # T >= 1 means >= k groups hold a key >= T, k distinct entries of the segment: its k-th largest is >= T
    threshold = _kth_largest(maxima, k, KEY_BITS)
    # pass 2: candidates in index order, keys above T in slots 0 .. CAP - 1, the first k equal to T after.
    # Both counts in one int32 (tiles < 2^15 entries: the ties' count sits in the signed high half): one scan
    # and one sum per tile. Only the index is stored (each scattered store costs a layout conversion); the keys
    # are read again at the end
    CAP: tl.constexpr = CAND - K_P2
    cand = cand_ptr + program * CAND
    n_above = 0
    n_tie = 0
    for off in range(0, length, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        live = idx < length
        u = _unsigned_key(tl.load(src + idx, mask=live, other=0).to(tl.int32), live, KEY_BITS)
        above = u > threshold
        tie = live & (u == threshold)
        both = above.to(tl.int32) + (tie.to(tl.int32) << 16)
        counts = tl.cumsum(both)
        slot = tl.where(above, n_above + (counts & 65535) - 1, CAP + n_tie + (counts >> 16) - 1)
        tl.store(cand + slot, idx, mask=(above & (slot < CAP)) | (tie & (slot < CAP + k)))
        total = tl.sum(both)
        n_above += total & 65535
        n_tie += total >> 16
    overflow = n_above > CAP
    if SEGMENTED:
        tl.atomic_max(flags_ptr + row, overflow.to(tl.int32))
    else:
        tl.store(flags_ptr + row, overflow.to(tl.int32))
    # the k best candidates are the segment's top k: every key left out is below it. Ties at the k-th largest
    # all sit in one region (above T, or equal to it), in index order there: so candidate order orders equal
    # keys like their indices, which the row-wise stages after a SEGMENTED launch rely on
    tl.debug_barrier()  # the candidates were stored by other threads of this program
    s = tl.arange(0, CAND)
    live = tl.where(s < CAP, s < n_above, s - CAP < tl.minimum(n_tie, k))
    idx = tl.load(cand + s, mask=live, other=0)
    u = _unsigned_key(tl.load(src + idx, mask=live, other=0).to(tl.int32), live, KEY_BITS)
    take = _take(u, live, k, KEY_BITS)
    if SEGMENTED:
        slot = tl.cumsum(take) - 1
        written = (take > 0) & (n_above <= CAP)
        base = program * k
        tl.store(picks_ptr + base + slot, start + idx, mask=written)
        tl.store(keys_ptr + base + slot, u.to(tl.int32, bitcast=True), mask=written)
        # an overflowing segment pads all its slots: the row-wise stages must only see keys below 2^KEY_BITS
        # (more than k keys above their cut would be stored past the row); the radix path redoes the row
        pad = tl.arange(0, K_P2)
        pad_mask = (pad >= tl.where(n_above <= CAP, tl.sum(take), 0)) & (pad < k)
        tl.store(keys_ptr + base + pad, tl.zeros((K_P2,), tl.int32), mask=pad_mask)
        tl.store(picks_ptr + base + pad, tl.zeros((K_P2,), tl.int32), mask=pad_mask)
    else:  # (this association: cumsum - 1 taken apart spilled 16 bytes at a sweep launch, 4096 candidates)
        tl.store(picks_ptr + row.to(tl.int64) * k + tl.cumsum(take) - 1, idx, mask=(take > 0) & (n_above <= CAP))


@triton.jit
def _finish_kernel(picks_ptr, values_ptr, visible_ptr, blocks_ptr, out_ptr, width, k, NB, BS,
                   MODE: tl.constexpr, K_P2: tl.constexpr, PDL: tl.constexpr):
    """Sort a row's picks ascending and map them: VISIBLE: picks >= visible -> -1; FINITE: picks whose
    value is -inf -> -1 (last); CANDIDATE_ROWS: compact column -> row id (-1 for a -1 block), -inf -> -1."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    row = tl.program_id(0)
    i = tl.arange(0, K_P2)
    present = i < k
    pick = tl.load(picks_ptr + row.to(tl.int64) * k + i, mask=present, other=0)
    dropped = ~present
    if MODE == VISIBLE:
        limit = tl.load(visible_ptr + row)
    else:
        value = tl.load(values_ptr + row.to(tl.int64) * width + pick, mask=present, other=0.0)
        dropped = dropped | (value == float("-inf"))
        if MODE == CANDIDATE_ROWS:
            block = tl.load(blocks_ptr + row.to(tl.int64) * NB + pick // BS, mask=present, other=-1)
            pick = tl.where(block >= 0, block * BS + pick % BS, -1)
    big = 2147483647  # dropped picks sort last
    pick = tl.sort(tl.where(dropped, big, pick))
    if MODE == VISIBLE:
        pick = tl.where(pick < limit, pick, -1)
    else:
        pick = tl.where(pick == big, -1, pick)
    tl.store(out_ptr + row.to(tl.int64) * k + i, pick, mask=present)


@triton.jit
def _row_topk_kernel(bits_ptr, visible_ptr, blocks_ptr, out_ptr, width, k, NB, BS, NEG_INF, MODE: tl.constexpr,
                     KEY_BITS: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr, K_P2: tl.constexpr,
                     NB_P2: tl.constexpr, RADIX: tl.constexpr, PDL: tl.constexpr):
    """Single path, one row per program: the row's k best (_take) and _finish_kernel's mapping in one launch.
    The row is one tile of HEAD entries (padded), or with TAIL > 0 its first HEAD entries and a TAIL-long part
    after them (padded: single_parts), ranked together (_take_parts). The picks come out in index order, so
    ascending where the mapping keeps the order (VISIBLE, FINITE, and CANDIDATE_ROWS over ascending blocks, as
    candidate_blocks publishes them), with the -1 picks after the kept ones. CANDIDATE_ROWS maps the stored picks
    read back; a row whose blocks are not ascending (or with a finite score in a -1 block, whose -1 sorts first) is
    sorted then, as _finish_kernel sorts."""
    pdl_wait(PDL)  # before any access to what earlier kernels wrote (pdl.py)
    row = tl.program_id(0)
    pos = tl.arange(0, HEAD)
    live = pos < width
    src = bits_ptr + row.to(tl.int64) * width
    bits = tl.load(src + pos, mask=live, other=0).to(tl.int32)
    if TAIL > 0:
        pos_tail = HEAD + tl.arange(0, TAIL)
        live_tail = pos_tail < width
        bits_tail = tl.load(src + pos_tail, mask=live_tail, other=0).to(tl.int32)
        take, take_tail = _take_parts(_unsigned_key(bits, live, KEY_BITS), live,
                                      _unsigned_key(bits_tail, live_tail, KEY_BITS), live_tail, k, KEY_BITS, RADIX)
    else:
        take = _take(_unsigned_key(bits, live, KEY_BITS), live, k, KEY_BITS, RADIX)
    out = out_ptr + row.to(tl.int64) * k
    s = tl.arange(0, K_P2)
    if MODE == VISIBLE:  # ascending: the picks past visible are the last ones
        visible = tl.load(visible_ptr + row)
        tl.store(out + tl.cumsum(take) - 1, tl.where(pos < visible, pos, -1), mask=take > 0)
        if TAIL > 0:
            tl.store(out + tl.sum(take) + tl.cumsum(take_tail) - 1, tl.where(pos_tail < visible, pos_tail, -1),
                     mask=take_tail > 0)
    else:  # -inf picks dropped, the others compacted; -1 after them
        kept = take & (bits != NEG_INF).to(tl.int32)
        tl.store(out + tl.cumsum(kept) - 1, pos, mask=kept > 0)
        n = tl.sum(kept)
        if TAIL > 0:
            kept_tail = take_tail & (bits_tail != NEG_INF).to(tl.int32)
            tl.store(out + n + tl.cumsum(kept_tail) - 1, pos_tail, mask=kept_tail > 0)
            n += tl.sum(kept_tail)
        if MODE == FINITE:
            tl.store(out + s, tl.full((K_P2,), -1, tl.int32), mask=(s >= n) & (s < k))
        else:  # the k picks (not the row) mapped to row ids: fewer registers than the row's tile
            tl.debug_barrier()  # the picks were stored by other threads of this program
            present = s < n
            pick = tl.load(out + s, mask=present, other=0)
            block = tl.load(blocks_ptr + row.to(tl.int64) * NB + pick // BS, mask=present, other=-1)
            pick = tl.where(block >= 0, block * BS + pick % BS, -1)
            j = tl.arange(0, NB_P2)
            here = tl.load(blocks_ptr + row.to(tl.int64) * NB + j, mask=j < NB, other=-1)
            after = tl.load(blocks_ptr + row.to(tl.int64) * NB + j + 1, mask=j + 1 < NB, other=-1)
            unordered = (tl.sum(((after >= 0) & ((here < 0) | (after <= here))).to(tl.int32))
                         + tl.sum((present & (block < 0)).to(tl.int32))) > 0
            big = 2147483647  # dropped picks sort last
            pick = tl.where(present, pick, big)
            if unordered:
                pick = tl.sort(pick)
            tl.debug_barrier()  # every thread has read its picks back before any is overwritten
            tl.store(out + s, tl.where(pick == big, -1, pick), mask=s < k)


def single_fits(rows: int, width: int, k: int, device) -> bool:
    """The single path's choice (shapes only; never while SINGLE_ON is off): rows of at most SINGLE_WIDTH
    entries, too few to fill the GPU (where the radix split path would be chosen: decode); many rows keep
    the paths the prefill sweeps timed."""
    return (SINGLE_ON and 0 < k <= width <= SINGLE_WIDTH
            and not rowwise_fits(rows, width, k, device) and not filter_fits(rows, width, k, device))


def _single(split, block, chunk) -> bool:
    """No path forced: the ops may take the single path."""
    return split is None and block is None and chunk is None


def row_topk(scores: torch.Tensor, k: int, mode: int, visible: torch.Tensor | None = None,
             blocks: torch.Tensor | None = None, block_size: int = 1) -> torch.Tensor:
    """The single path: scores [rows, width] (width <= SINGLE_WIDTH) -> the finished picks int32 [rows, k], as
    select_topk then finish(mode) give them."""
    rows, width = scores.shape
    key_bits = _KEY_BITS[scores.dtype]
    out = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    dummy = out  # an operand the mode never reads
    visible = dummy if visible is None else visible.contiguous()
    blocks = dummy if blocks is None else blocks.contiguous()
    nb = blocks.shape[-1] if mode == CANDIDATE_ROWS else 0
    head, tail = single_parts(width)
    _row_topk_kernel[(rows,)](scores.contiguous().view(_BITS_VIEW[key_bits]), visible, blocks, out, width, k, nb,
                              block_size, _NEG_INF_BITS[scores.dtype], MODE=mode.value, KEY_BITS=key_bits,
                              HEAD=head, TAIL=tail, K_P2=max(16, triton.next_power_of_2(k)),
                              NB_P2=max(16, triton.next_power_of_2(nb)), RADIX=SINGLE_RADIX,
                              num_warps=single_warps(head), **launch_options(scores.device))
    return out


def single_warps(head: int) -> int:
    """The single kernel's warps for a row head of `head` entries: SINGLE_KEYS_PER_THREAD keys a thread, 4 to
    SINGLE_MAX_WARPS warps."""
    return min(SINGLE_MAX_WARPS, max(4, head // (32 * SINGLE_KEYS_PER_THREAD)))


def single_parts(width: int) -> tuple[int, int]:
    """The single kernel's (HEAD, TAIL) for a row of `width` (>= 1) entries: one tile of the next power of two (at
    least 16, a tile's smallest; TAIL 0), or with SINGLE_SPLIT, for a width that is no power of two above 16, the
    largest power of two below it and a power of two (at least 16) holding the rest: a 4120-wide row (4K context)
    ranked as 4096 + 32 entries, not as 8192."""
    head = 1 << (width.bit_length() - 1)
    if not SINGLE_SPLIT or width <= 16 or width == head:
        return max(16, triton.next_power_of_2(width)), 0
    return head, max(16, triton.next_power_of_2(width - head))


def rowwise_fits(rows: int, width: int, k: int, device) -> bool:
    """The row-wise path's choice (shapes only): each stage must shrink the row (2k <= CHUNK), and the
    rows fill the GPU at least once in FIT_CHUNK-wide pieces; fewer rows go to the radix split path (decode,
    where the 11-30 bench measured it 1.7-4.3x faster than torch.topk)."""
    return 2 * k <= CHUNK and rows * triton.cdiv(width, FIT_CHUNK) >= _num_sms(device)


def select_rowwise(scores: torch.Tensor, k: int, chunk: int = CHUNK, num_warps: int | None = None) -> torch.Tensor:
    """The row-wise path (see the module docstring): indices int32 [rows, k] ascending, the same picks as
    select_topk. Stages while a row is wider than one chunk; buffers from the shapes only."""
    if 2 * k > chunk:
        raise ValueError(f"select_rowwise: k = {k} must be at most chunk / 2 = {chunk // 2}")
    key_bits = _KEY_BITS[scores.dtype]
    return _rowwise_stages(scores.contiguous().view(_BITS_VIEW[key_bits]), None, k, key_bits, chunk, num_warps)


def _rowwise_stages(keys: torch.Tensor, index: torch.Tensor | None, k: int, key_bits: int, chunk: int = CHUNK,
                    num_warps: int | None = None) -> torch.Tensor:
    """The row-wise stages from score bits [rows, width] (index None) or from candidates: unsigned keys
    (int32 bits) and their indices [rows, width], equal keys in index order. Picks int32 [rows, k] ascending."""
    rows, width = keys.shape
    first = index is None
    picks = torch.empty(rows, k, dtype=torch.int32, device=keys.device)
    k_p2 = triton.next_power_of_2(k)
    while True:
        # a row narrower than the chunk (a later stage: chunks x k candidates) takes a chunk of its width,
        # not mostly dead lanes; at least 2k, so that a stage with several chunks still shrinks the row
        size = max(2 * k_p2, min(chunk, triton.next_power_of_2(width)))
        chunks = triton.cdiv(width, size)
        last = chunks == 1
        out_width = chunks * k
        out_keys = picks if last else torch.empty(rows, out_width, dtype=torch.int32, device=keys.device)
        out_index = picks if last else torch.empty(rows, out_width, dtype=torch.int32, device=keys.device)
        # later stages carry the first stage's unsigned keys (< 2^KEY_BITS): the same bisection depth
        _chunk_select_kernel[(rows, chunks)](keys, keys if index is None else index, out_keys, out_index, width, k,
                                             out_width, FIRST=first, LAST=last, KEY_BITS=key_bits,
                                             CHUNK=size, K_P2=k_p2, num_warps=num_warps or CHUNK_WARPS,
                                             **launch_options(keys.device))
        if last:
            return picks
        keys, index, width, first = out_keys, out_index, out_width, False


def _candidate_room(k: int) -> bool:
    """Room for 3k candidates above a filter threshold (CAND - K_P2 slots): k <= 512 at the default CAND."""
    return 4 * triton.next_power_of_2(k) <= CAND


def filter_fits(rows: int, width: int, k: int, device) -> bool:
    """The filter path's choice (shapes only; never while FILTER_ON is off): one program per row, so at least
    FILTER_ROWS_PER_SM rows per SM; rows wider than one CHUNK (narrower ones take the row-wise path in one
    pass); and _candidate_room."""
    return FILTER_ON and rows >= FILTER_ROWS_PER_SM * _num_sms(device) and width > CHUNK and _candidate_room(k)


def filter_segments(rows: int, width: int, k: int, device, on: bool | None = None) -> int:
    """Segments per row of the segmented filter path (shapes only), 0 where it is not chosen (SEGMENTED_ON
    off, filter_fits, or more than SEGMENT_MAX_ROWS rows): enough to bring the rows up to
    SEGMENT_PROGRAMS_PER_SM programs per SM, none narrower than SEGMENT; chosen from 2 segments per row where
    the programs fill the GPU at least once (fewer rows: the radix split path) and _candidate_room. on:
    instead of SEGMENTED_ON (the benchmarks time the path whether or not it is on)."""
    if (not (SEGMENTED_ON if on is None else on) or filter_fits(rows, width, k, device) or rows > SEGMENT_MAX_ROWS
            or not _candidate_room(k)):
        return 0
    segments = min(triton.cdiv(SEGMENT_PROGRAMS_PER_SM * _num_sms(device), rows), width // SEGMENT)
    return segments if segments >= 2 and rows * segments >= _num_sms(device) else 0


def segment_plan(width: int, segments: int, block: int = FILTER_BLOCK) -> tuple[int, int]:
    """(segments, entries per segment) of a row split into about `segments` segments of whole tiles (fewer
    where the tiles run out; 1 segment: the whole row)."""
    if segments <= 1:
        return 1, width
    seg_width = triton.cdiv(triton.cdiv(width, segments), block) * block
    return triton.cdiv(width, seg_width), seg_width


def select_filtered(scores: torch.Tensor, k: int, groups: int = GROUPS, sample: int = SAMPLE, cand: int = CAND,
                    block: int = FILTER_BLOCK, num_warps: int = FILTER_WARPS,
                    flags: torch.Tensor | None = None, segments: int = 1) -> torch.Tensor:
    """The filter path (see the module docstring): indices int32 [rows, k] in no order, the same picks as
    select_topk; rows whose candidates overflow are redone by the radix path,
    launched for flagged rows only. flags: an int32 [rows] buffer for the overflow flags (the sweep reads it);
    all powers of 2. segments > 1: each row in that many segments of whole tiles (fewer where the tiles run
    out), one program each, whose k best the row-wise stages rank."""
    rows, width = scores.shape
    key_bits = _KEY_BITS[scores.dtype]
    k_p2 = triton.next_power_of_2(k)
    if not (k_p2 < cand and LINE.value <= groups <= block < 1 << 15):  # (two counts share an int32)
        raise ValueError(f"select_filtered: needs next_power_of_2(k) = {k_p2} < cand = {cand} and "
                         f"{LINE.value} <= groups = {groups} <= block = {block} < 2^15")
    segments, seg_width = segment_plan(width, segments, block)
    if segments > 1 and seg_width < 2 * k_p2:
        raise ValueError(f"select_filtered: {segments} segments of {seg_width} entries, but each needs at least "
                         f"2 x next_power_of_2(k) = {2 * k_p2} (the row-wise stages must shrink the row); ask for "
                         f"at most {width // (2 * k_p2)}")
    bits = scores.contiguous().view(_BITS_VIEW[key_bits])
    candidates = torch.empty(rows * segments, cand, dtype=torch.int32, device=scores.device)
    picks = torch.empty(rows, segments * k, dtype=torch.int32, device=scores.device)
    keys = torch.empty_like(picks) if segments > 1 else picks  # (not written without segments)
    if flags is None:  # (segments raise a row's flag: zeroed; one program per row stores it)
        flags = (torch.zeros if segments > 1 else torch.empty)(rows, dtype=torch.int32, device=scores.device)
    elif segments > 1:
        flags.zero_()
    _filter_kernel[(rows, segments)](bits, candidates, picks, keys, flags, width, seg_width, k, KEY_BITS=key_bits,
                                     GROUPS=groups, SAMPLE=sample, CAND=cand, K_P2=k_p2, BLOCK=block,
                                     SEGMENTED=segments > 1, num_warps=num_warps, **launch_options(bits.device))
    if segments > 1:
        picks = _rowwise_stages(keys, picks, k, key_bits)
    return _select_radix(bits, k, picks, flags=flags)


def topk_path(rows: int, width: int, k: int, device) -> str:
    """The path select_topk takes by shape: "filter", "segmented" (filter_segments), "rowwise" or "radix"."""
    if filter_fits(rows, width, k, device):
        return "filter"
    if filter_segments(rows, width, k, device):
        return "segmented"
    return "rowwise" if rowwise_fits(rows, width, k, device) else "radix"


def _select_radix(bits: torch.Tensor, k: int, picks: torch.Tensor, split: int | None = None,
                  block: int | None = None, flags: torch.Tensor | None = None) -> torch.Tensor:
    """The radix path on score bits [rows, width] into picks; flags: only the rows whose flag is set."""
    rows, width = bits.shape
    key_bits = bits.element_size() * 8
    npass = key_bits // 8
    programs = PROGRAMS_PER_SM * _num_sms(bits.device)  # enough to fill the GPU a few times over
    if block is None:
        block = BLOCK if rows * width >= programs * BLOCK else SMALL_BLOCK
    tiles = triton.cdiv(width, block)
    if split is None:
        split = triton.cdiv(programs, rows)
    chunk = triton.cdiv(tiles, max(1, min(split, tiles))) * block
    split = triton.cdiv(width, chunk)  # (a runtime argument: new shapes compile nothing new)
    counters = torch.zeros(rows * (npass * 256 + 1), dtype=torch.int32, device=bits.device)
    hist, count = counters[:rows * npass * 256], counters[rows * npass * 256:]
    ties = torch.empty(rows * split * 256, dtype=torch.int32, device=bits.device)
    warps = 8 if block >= BLOCK else 4
    flagged = flags is not None
    flags = picks if flags is None else flags  # (not read unless flagged)
    for p in range(npass):
        _histogram_kernel[(rows, split)](bits, hist, ties, flags, width, chunk, k, split, P=p, NPASS=npass,
                                         KEY_BITS=key_bits, BLOCK=block, FLAGGED=flagged, num_warps=warps,
                                         **launch_options(bits.device))
    _compact_kernel[(rows, split)](bits, hist, ties, count, picks, flags, width, chunk, k, split, NPASS=npass,
                                   KEY_BITS=key_bits, SPLIT_P2=triton.next_power_of_2(split), BLOCK=block,
                                   FLAGGED=flagged, num_warps=warps, **launch_options(bits.device))
    return picks


def select_topk(scores: torch.Tensor, k: int, split: int | None = None, block: int | None = None,
                chunk: int | None = None) -> torch.Tensor:
    """Indices int32 [rows, k] (in no order) of the k largest of each row of scores [rows, width] (bf16,
    fp16 or fp32), ties to the lower index. split/block force the radix path with those programs per row
    and tile; chunk forces the row-wise path with that chunk; none: the path topk_path picks by shape."""
    rows, width = scores.shape
    if scores.dtype not in _KEY_BITS:
        raise TypeError(f"select_topk: scores must be bf16, fp16 or fp32, got {scores.dtype}")
    if not 0 < k <= width:
        raise ValueError(f"select_topk: k = {k} must be in [1, {width}] (the row width)")
    if width >= 1 << 31:
        raise ValueError(f"select_topk: {width} entries per row exceed 2^31")
    auto = split is None and block is None and chunk is None
    path = topk_path(rows, width, k, scores.device) if auto else "rowwise" if chunk is not None else "radix"
    if path == "filter":
        return select_filtered(scores, k)
    if path == "segmented":
        return select_filtered(scores, k, segments=filter_segments(rows, width, k, scores.device))
    if path == "rowwise":
        return select_rowwise(scores, k, chunk or CHUNK)
    picks = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    return _select_radix(scores.contiguous().view(_BITS_VIEW[_KEY_BITS[scores.dtype]]), k, picks, split, block)


def finish(picks: torch.Tensor, mode: int, values: torch.Tensor | None = None, visible: torch.Tensor | None = None,
           blocks: torch.Tensor | None = None, block_size: int = 1) -> torch.Tensor:
    """picks int32 [rows, k] -> sorted, mapped int32 [rows, k] (see _finish_kernel's modes)."""
    rows, k = picks.shape
    out = torch.empty_like(picks)
    dummy = picks  # an operand the mode never reads
    values = dummy if values is None else values.contiguous()
    visible = dummy if visible is None else visible.contiguous()
    blocks = dummy if blocks is None else blocks.contiguous()
    width = values.shape[-1] if mode != VISIBLE else 0
    nb = blocks.shape[-1] if mode == CANDIDATE_ROWS else 0
    _finish_kernel[(rows,)](picks, values, visible, blocks, out, width, k, nb, block_size, MODE=mode.value,
                            K_P2=max(16, triton.next_power_of_2(k)), num_warps=4, **launch_options(picks.device))
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def topk_indices_triton(scores, k, visible, split=None, block=None, chunk=None):
    """`dsflash::topk_indices` on the GPU: int32 [..., k] ascending, -1 for picks j >= visible."""
    lead = scores.shape[:-1]
    if k == 0 or lead.numel() == 0:
        return torch.full((*lead, k), -1, dtype=torch.int32, device=scores.device)
    if _single(split, block, chunk) and single_fits(lead.numel(), scores.shape[-1], k, scores.device):
        return row_topk(_rows(scores), k, VISIBLE, visible=visible.reshape(-1)).view(*lead, k)
    picks = select_topk(_rows(scores), k, split, block, chunk)
    return finish(picks, VISIBLE, visible=visible.reshape(-1)).view(*lead, k)


def top_blocks_triton(block_scores, k, split=None, block=None, chunk=None):
    """The k best blocks of block_scores [..., nblocks] (+inf pinned), ascending, -1 for -inf picks."""
    lead = block_scores.shape[:-1]
    if k == 0 or lead.numel() == 0:
        return torch.full((*lead, k), -1, dtype=torch.int32, device=block_scores.device)
    values = _rows(block_scores).contiguous()
    if _single(split, block, chunk) and single_fits(*values.shape, k, values.device):
        return row_topk(values, k, FINITE).view(*lead, k)
    return finish(select_topk(values, k, split, block, chunk), FINITE, values=values).view(*lead, k)


def candidate_topk_triton(scores, blocks, block_size, k, split=None, block=None, chunk=None):
    """`dsflash::candidate_topk` on the GPU: top-k of the compact scores, remapped to row ids, ascending,
    -1 for picks whose score is -inf."""
    lead = scores.shape[:-1]
    if k == 0 or lead.numel() == 0:
        return torch.full((*lead, k), -1, dtype=torch.int32, device=scores.device)
    values = _rows(scores).contiguous()
    if _single(split, block, chunk) and single_fits(*values.shape, k, values.device):
        return row_topk(values, k, CANDIDATE_ROWS, blocks=_rows(blocks), block_size=block_size).view(*lead, k)
    picks = select_topk(values, k, split, block, chunk)
    return finish(picks, CANDIDATE_ROWS, values=values, blocks=_rows(blocks), block_size=block_size).view(*lead, k)
