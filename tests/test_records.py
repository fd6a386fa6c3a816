"""Cache record formats (custom_ops/records.py; MODEL.md 6-7): sizes, byte layouts, codecs against the model's
quantize-dequantize functions bit for bit, the dsflash::record_write_ / record_read ops, and the Triton write
kernel under the interpreter (in a subprocess: see test_triton_write_matches_reference_interpreted)."""


import pytest
import torch

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile import quant
from dsflash_compile.custom_ops import records
from dsflash_compile.custom_ops.records import FORMATS, decode_reference, encode_reference, record_bytes
from interp import report, requires_interpreter, run_interpreted

ops = torch.ops.dsflash
BLOCK = {"bf16": 32, "fp8": 32, "nvfp4": 16, "mxfp4": 32}  # bf16: the group size used to build test rows
QDQ = {
    "bf16": lambda x: x.bfloat16().to(x.dtype),
    "fp8": lambda x: quant.fp8_qdq(x, 32),
    "nvfp4": lambda x: quant.fp4_qdq_e4m3(x, 16),
    "mxfp4": lambda x: quant.fp4_qdq_ue8m0(x, 32),
}
BF16_MAX = torch.finfo(torch.bfloat16).max


def gen(seed):
    return torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that comparisons see the sign of zero and NaN payloads."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, f"{what}: {len(diff)} differing values, first at {diff[0].tolist()}: " \
                              f"{a[tuple(diff[0])].item()!r} vs {b[tuple(diff[0])].item()!r}"


# ----------------------------------------------------------------------------------------------- inputs


def random_rows(seed: int, rows: int, dim: int, block: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Gaussian rows whose groups of `block` have magnitudes 2^-40..2^40, plus special groups: all +0,
    all -0, one tiny value among zeros, bf16-max values, bf16 subnormals, one huge outlier, negatives only."""
    g = gen(seed)
    x = torch.randn(rows, dim // block, block, generator=g)
    x = x * torch.exp2(torch.randint(-40, 41, (rows, dim // block, 1), generator=g).float())
    x = x.flatten(-2)
    specials = [
        torch.zeros(block),
        torch.full((block,), -0.0),
        torch.zeros(block).index_fill_(0, torch.tensor([3]), -1e-30),
        torch.randn(block, generator=g).sign() * BF16_MAX,
        torch.randn(block, generator=g) * 1e-40,  # bf16 subnormals
        torch.randn(block, generator=g).index_fill_(0, torch.tensor([5]), 3e4),
        -torch.rand(block, generator=g),
    ]
    for i, s in enumerate(specials):
        r, c = divmod(i, dim // block)
        if r < rows:
            x[r, c * block:(c + 1) * block] = s
    return x.to(dtype)


def anchored(values: torch.Tensor, anchor: float, block: int, dim: int) -> torch.Tensor:
    """fp32 rows [R, dim]: `values` in groups of block-1, each group led by `anchor` (its amax, so the
    group's scale is known), zero padded."""
    per = block - 1
    n_groups = -(-values.numel() // per)
    body = torch.zeros(n_groups * per)
    body[:values.numel()] = values
    g = torch.cat([torch.full((n_groups, 1), anchor), body.view(n_groups, per)], dim=1)
    rows = -(-n_groups * block // dim)
    out = torch.zeros(rows * dim)
    out[:g.numel()] = g.flatten()
    return out.view(rows, dim)


def e4m3_points() -> torch.Tensor:
    """Every finite E4M3 magnitude, every midpoint between neighbours (ties) and the fp32 values one ulp
    either side of each midpoint, with both signs."""
    v = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = (v[:-1].double() + v[1:].double()).div(2).float()  # exact: 5 significant bits
    pts = torch.cat([v, mid, torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(0.0))])
    return torch.cat([pts, -pts])


def e2m1_points() -> torch.Tensor:
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    pts = torch.cat([mags, mid, torch.nextafter(mid, torch.tensor(9.0)), torch.nextafter(mid, torch.tensor(0.0))])
    return torch.cat([pts, -pts])


def tricky_rows(fmt: str, dim: int) -> torch.Tensor:
    """fp32 rows that put x / scale exactly on every rounding tie (and one ulp either side) of the format's
    element code, and, for nvfp4, amax / 6 on every tie of the E4M3 scale (normal and subnormal)."""
    if fmt in ("bf16", "fp8"):
        pts = e4m3_points()
        parts = [anchored(pts * 2.0**k, 448.0 * 2.0**k, 32, dim) for k in (0, -12, 20)]
    elif fmt == "mxfp4":
        pts = e2m1_points()
        parts = [anchored(pts * 2.0**k, 6.0 * 2.0**k, 32, dim) for k in (0, -30, 25, -125)]
    else:  # nvfp4: scale s = e4m3(amax / 6) is exactly s when amax = 6 s
        pts = e2m1_points()
        parts = [anchored(pts * s, 6.0 * s, 16, dim) for s in (1.0, 2.0**-9, 7 * 2.0**-9, 0.8125, 448.0)]
        # scale ties: amax = 6 * (E4M3 point), the group's other values spread below it
        amax = 6.0 * e4m3_points().abs().unique()
        amax = amax[(amax > 0) & (amax <= 6 * 448)]
        spread = torch.linspace(-1, 1, 15)
        groups = torch.cat([amax.unsqueeze(1), amax.unsqueeze(1) * spread], dim=1)  # [n, 16]
        pad = -groups.numel() % dim
        parts.append(torch.cat([groups.flatten(), torch.zeros(pad)]).view(-1, dim))
    return torch.cat(parts)


# ---------------------------------------------------------------------------------------- record sizes


def test_record_bytes_release_dims():
    """MODEL.md 7: window ring FP8 528 B, compressed KV NVFP4 288 B, index keys MXFP4 68 B, bf16 1024 B."""
    assert record_bytes("fp8", 512) == 528
    assert record_bytes("nvfp4", 512) == 288
    assert record_bytes("mxfp4", 128) == 68
    assert record_bytes("bf16", 512) == 1024
    assert FORMATS == ("bf16", "fp8", "nvfp4", "mxfp4")


@pytest.mark.parametrize("dim", [32, 64, 96, 128, 512, 1024])
def test_record_bytes_formula(dim):
    assert record_bytes("bf16", dim) == 2 * dim
    assert record_bytes("fp8", dim) == dim + dim // 32
    assert record_bytes("nvfp4", dim) == dim // 2 + dim // 16
    assert record_bytes("mxfp4", dim) == dim // 2 + dim // 32
    for fmt in FORMATS:
        assert encode_reference(torch.zeros(3, dim), fmt).shape == (3, record_bytes(fmt, dim))


@pytest.mark.parametrize("fmt, dim", [("fp4", 64), ("FP8", 64), ("fp8", 48), ("nvfp4", 40), ("mxfp4", 16),
                                      ("bf16", 0), ("fp8", -32), ("nvfp4", 32.0)])
def test_record_bytes_rejects(fmt, dim):
    with pytest.raises(ValueError, match="unknown record format" if fmt not in FORMATS else "multiple of"):
        record_bytes(fmt, dim)


def test_codecs_reject_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 16"):
        encode_reference(torch.zeros(2, 24), "nvfp4")
    with pytest.raises(TypeError, match="floating-point"):
        encode_reference(torch.zeros(2, 32, dtype=torch.int32), "fp8")
    with pytest.raises(ValueError, match=r"uint8 records \[\.\.\., 68\]"):
        decode_reference(torch.zeros(2, 67, dtype=torch.uint8), "mxfp4", 128)
    with pytest.raises(ValueError, match="uint8 records"):
        decode_reference(torch.zeros(2, 68, dtype=torch.int8), "mxfp4", 128)


# ------------------------------------------------------------------------------------ codecs vs QDQ


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_encode_is_qdq_bit_exact(fmt, dtype):
    """decode(encode(x)) == the release's QDQ of x, bit for bit, incl. zero/-0 groups, bf16 max, subnormals."""
    x = random_rows(1, 24, 512, BLOCK[fmt], dtype).view(2, 3, 4, 512)  # leading dims are batch dims
    rec = encode_reference(x, fmt)
    assert rec.dtype == torch.uint8 and rec.shape == (2, 3, 4, record_bytes(fmt, 512))
    assert_bit_equal(decode_reference(rec, fmt, 512, dtype), QDQ[fmt](x), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_encode_is_qdq_on_rounding_ties(fmt):
    """Every tie of the element rounding (E4M3 / E2M1) and of the nvfp4 E4M3 scale, and one ulp either side."""
    x = tricky_rows(fmt, 128)
    assert_bit_equal(decode_reference(encode_reference(x, fmt), fmt, 128, torch.float32), QDQ[fmt](x), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_is_exact_on_the_grid(fmt):
    """Values already on the format's grid (QDQ outputs) survive encode + decode unchanged, including
    all-zero groups and groups whose amax sits exactly at a power-of-two scale boundary."""
    x = random_rows(2, 16, 256, BLOCK[fmt])
    n = 256 // BLOCK[fmt]
    top = 6.0 if fmt in ("nvfp4", "mxfp4") else 448.0
    peak = top * torch.exp2((torch.arange(n) - n // 2).float())  # amax = largest code * a power of two
    boundary = (torch.rand(2, n, BLOCK[fmt], generator=gen(3)) * 2 - 1) * peak[:, None]
    boundary[0, :, 0] = peak
    boundary[1, :, 0] = -peak
    boundary = boundary.flatten(1).bfloat16()
    y = QDQ[fmt](torch.cat([x, boundary]))
    # fp8: a group at bf16's max has codes 255 * 2^120 that round up to 256 * 2^120 = 2^128 = inf, which is
    # no grid value (decode(encode(.)) still equals the QDQ there: both are inf)
    y = torch.where(y.isinf(), 0.0, y)
    assert_bit_equal(decode_reference(encode_reference(y, fmt), fmt, 256), y, fmt)


def test_decode_dtype():
    x = random_rows(4, 3, 64, 32)
    rec = encode_reference(x, "fp8")
    assert decode_reference(rec, "fp8", 64).dtype == torch.bfloat16
    assert_bit_equal(decode_reference(rec, "fp8", 64, torch.float32), quant.fp8_qdq(x.float()))


# -------------------------------------------------------------------------------------- byte layouts


def test_layout_bf16():
    rec = encode_reference(torch.tensor([1.0, -2.0, 2.0**-133]), "bf16")  # 0x3F80, 0xC000, 0x0001
    assert rec.tolist() == [0x80, 0x3F, 0x00, 0xC0, 0x01, 0x00]


def test_layout_fp8():
    """Codes first (byte i = value i), then one UE8M0 scale byte per 32 values."""
    x = torch.zeros(64)
    x[:4] = torch.tensor([448.0, -1.0, 0.5, -0.0])  # group 0: amax 448 -> scale 2^0 (byte 127)
    x[32], x[33] = 0.1875, -3 * 2.0**-12  # group 1: amax 0.1875 -> scale 2^ceil(log2(0.1875/448)) = 2^-11
    rec = encode_reference(x, "fp8")
    assert rec.shape == (66,)
    assert rec[:4].tolist() == [0x7E, 0xB8, 0x30, 0x80]  # 448, -1, 0.5, -0
    assert rec[32:34].tolist() == [0x7C, 0xBC]  # 384 = 1.5 * 2^8 (exponent field 15), -1.5 (sign, field 7)
    assert rec[4:32].eq(0).all() and rec[34:64].eq(0).all()
    assert rec[64:].tolist() == [127, 127 - 11]


def test_layout_nvfp4():
    """Packed E2M1 (value 2k low nibble, 2k+1 high; bit 3 = sign), then one E4M3 scale per 16 values."""
    x = torch.zeros(32)
    # group 0: amax 6 -> scale e4m3(1.0) = 0x38; ties 0.25 -> 0 and 1.25 -> 1 go down, 0.75 -> 1 goes up
    x[:6] = torch.tensor([6.0, -0.5, 1.0, 0.25, 0.75, 1.25])
    x[16:18] = torch.tensor([3.0, -1.5])  # group 1: amax 3 -> scale e4m3(0.5) = 0x30; 6.0 and -3.0 after it
    rec = encode_reference(x, "nvfp4")
    assert rec.shape == (18,)
    assert rec[:3].tolist() == [0x7 | (0x9 << 4), 0x2 | (0x0 << 4), 0x2 | (0x2 << 4)]
    assert rec[8].item() == 0x7 | (0xD << 4)
    assert rec[16:].tolist() == [0x38, 0x30]


def test_layout_mxfp4():
    """Packed E2M1 as nvfp4, then one UE8M0 scale per 32 values."""
    x = torch.zeros(64)
    x[:2] = torch.tensor([6.0, -0.5])  # group 0: amax 6 -> scale 2^0 (byte 127)
    x[32:34] = torch.tensor([-12.0, 5.0])  # group 1: amax 12 -> scale 2^1; -6 and 2.5 (tie -> 2: code 4)
    rec = encode_reference(x, "mxfp4")
    assert rec.shape == (34,)
    assert rec[0].item() == 0x7 | (0x9 << 4)
    assert rec[16].item() == 0xF | (0x4 << 4)
    assert rec[32:].tolist() == [127, 128]


# ------------------------------------------------------------------------------------------------- ops


def write_inputs(fmt, dim=64, batch=2, seq=4, bmax=3, n=6, seed=5, rows_dtype=torch.bfloat16,
                 slots_dtype=torch.int64):
    """Fresh cache (filled with a 0xA5 sentinel), rows and distinct slots per sequence with some -1."""
    g = gen(seed)
    rows = random_rows(seed, batch * seq, dim, BLOCK[fmt], rows_dtype).view(batch, seq, dim)
    slots = torch.stack([torch.randperm(n, generator=g)[:seq] for _ in range(batch)])
    slots[0, 1] = -1
    slots[-1, -1] = -1
    if fmt == "bf16" and seed % 2:  # bf16 records: a bf16 cache [.., dim] (the other seeds use uint8 records)
        cache = torch.full((bmax, n, dim), -7.0, dtype=torch.bfloat16)
    else:
        cache = torch.full((bmax, n, record_bytes(fmt, dim)), 0xA5, dtype=torch.uint8)
    return cache, rows, slots.to(slots_dtype)


@pytest.mark.parametrize("test_util", ["test_schema", "test_autograd_registration", "test_faketensor",
                                       "test_aot_dispatch_dynamic"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_record_write_opcheck(fmt, test_util):
    for seed in (5, 6):  # uint8 records, and for bf16 also a bf16 cache
        torch.library.opcheck(ops.record_write_.default, (*write_inputs(fmt, seed=seed), fmt), test_utils=test_util)


@pytest.mark.parametrize("fmt", FORMATS)
def test_record_read_opcheck(fmt):
    cache, rows, slots = write_inputs(fmt)
    ops.record_write_(cache, rows, slots, fmt)
    torch.library.opcheck(ops.record_read.default, (cache, fmt, 64))
    if fmt == "bf16":
        torch.library.opcheck(ops.record_read.default, (cache.view(torch.bfloat16), fmt, 64))


@pytest.mark.parametrize("slots_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("seed", [5, 6])
@pytest.mark.parametrize("fmt", FORMATS)
def test_record_write_semantics(fmt, seed, slots_dtype):
    """cache[b, slots[b, s]] = encode(rows[b, s]) for slots >= 0; -1 skipped; rows b >= B and unlisted slots
    untouched; record_read gives the QDQ of the written rows."""
    cache, rows, slots = write_inputs(fmt, seed=seed, slots_dtype=slots_dtype)
    before = cache.clone()
    ops.record_write_(cache, rows, slots, fmt)
    expected = before.clone()
    for b in range(rows.shape[0]):
        for s in range(rows.shape[1]):
            slot = int(slots[b, s])
            if slot >= 0:
                expected[b, slot] = rows[b, s] if cache.dtype == torch.bfloat16 else encode_reference(rows[b, s], fmt)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(cache[rows.shape[0]:], before[rows.shape[0]:])  # B < Bmax: the rest is untouched
    read = ops.record_read(cache, fmt, 64)
    assert read.dtype == torch.bfloat16 and read.shape == (*cache.shape[:2], 64)
    b, s = (slots >= 0).nonzero(as_tuple=True)
    assert_bit_equal(read[b, slots[b, s].long()], QDQ[fmt](rows[b, s]), fmt)


def test_record_write_rejects():
    cache, rows, slots = write_inputs("fp8")
    with pytest.raises(ValueError, match="66 torch.uint8 elements, expected 36"):
        ops.record_write_(cache, rows, slots, "nvfp4")
    with pytest.raises(TypeError, match="uint8 records"):
        ops.record_write_(cache.view(torch.int8), rows, slots, "fp8")
    with pytest.raises(ValueError, match="B <= Bmax"):
        ops.record_write_(cache[:1], rows, slots, "fp8")
    with pytest.raises(ValueError, match="unknown record format"):
        ops.record_write_(cache, rows, slots, "e4m3")


# ------------------------------------------------------------------------------------ Triton kernel


def interpreter_checks() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: the Triton write kernel equals the reference, byte for byte.

    Cases: every format at dims 64, 128 and 96 (a non-power-of-two number of groups), bf16 and fp32 rows,
    non-contiguous rows, int32 slots, a bf16 cache and a uint8 "bf16" cache, and the tie-heavy rows of
    tricky_rows (every E4M3 / E2M1 tie, the nvfp4 scale ties) written through the kernel.
    """
    import triton

    assert triton.knobs.runtime.interpret, "TRITON_INTERPRET=1 must be set before triton is imported"
    cases = []
    for fmt in FORMATS:
        for dim, seed in ((64, 5), (128, 6), (96, 7)):
            cases.append((fmt, *write_inputs(fmt, dim=dim, seed=seed)))
        cases.append((fmt, *write_inputs(fmt, dim=64, seed=8, rows_dtype=torch.float32, slots_dtype=torch.int32)))
        cache, rows, slots = write_inputs(fmt, dim=128, seed=9)
        wide = torch.zeros(rows.shape[0], rows.shape[1], 160, dtype=rows.dtype)
        wide[..., 16:144] = rows
        cases.append((fmt, cache, wide[..., 16:144], slots))  # rows with a row stride of 160
        x = tricky_rows(fmt, 128)
        x = torch.cat([x, torch.zeros(-len(x) % 8, 128)]).view(-1, 8, 128)[:, :7]  # [B, 7, 128], B > 1
        slots = torch.arange(7).repeat(len(x), 1)
        slots[:, 3] = -1
        shape = (len(x) + 1, 8, record_bytes(fmt, 128))
        cases.append((fmt, torch.full(shape, 0x5A, dtype=torch.uint8), x, slots))
    for fmt, cache, rows, slots in cases:
        ref = cache.clone()
        records.record_write_reference(ref, rows, slots, fmt)
        records.record_write_triton(cache, rows, slots, fmt)
        what = f"{fmt} dim {rows.shape[-1]} rows {rows.dtype} {tuple(rows.stride())} cache {cache.dtype}"
        assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8)), what
    report({"name": "write", "cases": len(cases)})


@requires_interpreter
def test_triton_write_matches_reference_interpreted():
    """The Triton kernel, run by Triton's CPU interpreter, writes the reference's bytes.

    It runs in a subprocess with TRITON_INTERPRET=1 set from the start (interp.py says why).
    """
    assert run_interpreted("test_records", "interpreter_checks", timeout=300)["write"]["cases"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", FORMATS)
def test_record_write_cuda_matches_reference_and_graphs(fmt):
    """On CUDA the op runs the Triton kernel: same bytes as the CPU reference, also replayed in a CUDA graph."""
    pytest.importorskip("triton")
    for dim in (512, 128, 96):
        cache, rows, slots = write_inputs(fmt, dim=dim, batch=3, seq=40, bmax=4, n=64, seed=11)
        ref = cache.clone()
        records.record_write_reference(ref, rows, slots, fmt)
        cache = cache.cuda()
        ops.record_write_(cache, rows.cuda(), slots.cuda(), fmt)
        assert torch.equal(cache.cpu().view(torch.uint8), ref.view(torch.uint8)), (fmt, dim)
        x = tricky_rows(fmt, dim)[None]
        tricky = torch.zeros(1, len(x[0]), record_bytes(fmt, dim), dtype=torch.uint8)
        records.record_write_reference(tricky, x, torch.arange(len(x[0]))[None], fmt)
        out = torch.zeros_like(tricky).cuda()
        ops.record_write_(out, x.cuda(), torch.arange(len(x[0]))[None].cuda(), fmt)
        assert torch.equal(out.cpu(), tricky), (fmt, dim, "ties")

    cache, rows, slots = (t.cuda() for t in write_inputs(fmt, dim=512, batch=2, seq=8, n=16, seed=12))  # even
    ops.record_write_(cache, rows, slots, fmt)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.record_write_(cache, rows, slots, fmt)
    new_cache, new_rows, new_slots = write_inputs(fmt, dim=512, batch=2, seq=8, n=16, seed=14)  # same cache kind
    ref = new_cache.clone()
    records.record_write_reference(ref, new_rows, new_slots, fmt)
    cache.copy_(new_cache)
    rows.copy_(new_rows)
    slots.copy_(new_slots)
    graph.replay()
    assert torch.equal(cache.cpu().view(torch.uint8), ref.view(torch.uint8))
