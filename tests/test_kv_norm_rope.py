"""`dsflash::kv_norm_rope` (custom_ops/kv_norm_rope.py): the attention's key/value row in one launch.

The Triton kernel under the interpreter and on a GPU against the reference: the unquantized row within one bf16
ulp (the norm's sum and the rotation's products round in another order than torch's), and the FP8 row equal to
quant.fp8_qdq of the kernel's own unquantized row bit for bit (the FP8 step itself is exact); with the ring write
(kv_norm_rope_write_), the ring's bytes as record_write_ writes them; compiled for sm_90 without spills; opcheck and
errors."""

import functools

import pytest
import torch
from hopper import check_compiles_for_hopper, compile_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_mhc_fusion import bf16_ulps

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.custom_ops.kv_norm_rope import kv_norm_rope_reference
from dsflash_compile.custom_ops.mhc import rms_norm
from dsflash_compile.quant import fp8_qdq
from dsflash_compile.rope import rotation

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (leading dims, D, rope pairs, view of a wider projection); EPS is the release's
CASES = {
    "decode_release": ((1, 1), 512, 32, True),  # kv_a: the last 512 of wq_a + wkv's 1792 outputs
    "chunk": ((2, 3), 512, 32, False),
    "short_row": ((1, 5), 128, 16, False),
    "all_rotated": ((2, 2), 64, 32, True),
}
EPS = 1e-20


def case_inputs(lead, dim, pairs, view, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(*lead, dim + (1280 if view else 0), generator=g).bfloat16()
    kv = wide[..., -dim:]  # a column slice: rows strided
    weight = (torch.rand(dim, generator=g) + 0.5).bfloat16()
    positions = torch.randint(0, 4096, lead, generator=g)
    rot = rotation(positions, 1.0 / 10000 ** (torch.arange(pairs) / pairs))
    return tuple(t.to(device) for t in (kv, weight, rot))


def compare(run, device="cpu") -> dict:
    """{case: (unquantized ulps against the reference, FP8 row == fp8_qdq of the unquantized one)}."""
    results = {}
    for name, case in CASES.items():
        kv, weight, rot = case_inputs(*case, device=device)
        plain = run(kv, weight, EPS, rot, False)
        quantized = run(kv, weight, EPS, rot, True)
        results[name] = (bf16_ulps(plain, kv_norm_rope_reference(kv, weight, EPS, rot, False)),
                         torch.equal(quantized, fp8_qdq(plain)))
    return results


def query_inputs(lead, seed=0, device="cpu"):
    """q_a: the first 1280 of wq_a + wkv's 1792 outputs (a column slice), and q_norm's weight."""
    g = torch.Generator().manual_seed(seed + 7)
    q = torch.randn(*lead, 1792, generator=g).bfloat16()[..., :1280]
    return q.to(device), (torch.rand(1280, generator=g) + 0.5).bfloat16().to(device)


def compare_joint(run, alone, device="cpu") -> dict:
    """{case: (the query's ulps against its RMSNorm, kv equal to `alone`'s)} for dsflash::qkv_norm_rope."""
    results = {}
    for name, case in CASES.items():
        kv, weight, rot = case_inputs(*case, device=device)
        q, q_weight = query_inputs(case[0], device=device)
        qr, got = run(q, q_weight, kv, weight, EPS, rot, True)
        alone_kv = alone(kv, weight, EPS, rot, True)
        results[name] = (bf16_ulps(qr, rms_norm(q, q_weight, EPS)), torch.equal(got, alone_kv))
    return results


def ring_case(fmt, lead=(2, 1), slots=(5, -1), device="cpu"):
    """(ring, slots, kv, weight, rot) for kv_norm_rope_write_: a window ring of 8 slots a row (3 rows: more than the
    batch) in `fmt` ("bf16" a bf16 ring, "bf16-u8" bf16 records in a uint8 ring, "fp8") holding random bytes, and
    the slots the rows go to (-1: not written)."""
    from dsflash_compile.custom_ops.records import record_bytes

    kv, weight, rot = case_inputs(lead, 512, 32, True, device=device)
    g = torch.Generator().manual_seed(3)
    if fmt == "bf16":
        ring = torch.randn(3, 8, 512, generator=g).bfloat16()
    else:
        ring = torch.randint(0, 256, (3, 8, record_bytes(fmt.split("-")[0], 512)), generator=g, dtype=torch.uint8)
    return ring.to(device), torch.tensor(slots, device=device).view(lead), kv, weight, rot


def ring_writes(write, plain, device="cpu") -> dict:
    """{fmt-quantize-seq: `write` (a kv_norm_rope_write_) returns the rows `plain` (kv_norm_rope) returns, and the
    ring holds what record_write_'s reference writes of them (the other slots' bytes kept)}."""
    from dsflash_compile.custom_ops.records import record_write_reference

    results = {}
    for fmt in ("bf16", "bf16-u8", "fp8"):
        for quantize in (False, True):
            for lead, slots in (((2, 1), (5, -1)), ((1, 3), (0, 7, 2))):  # decode rows; one row's three tokens
                ring, slots_, kv, weight, rot = ring_case(fmt, lead, slots, device)
                want_ring = ring.clone()
                got = write(ring, slots_, fmt.split("-")[0], kv, weight, EPS, rot, quantize)
                record_write_reference(want_ring, got, slots_, fmt.split("-")[0])
                results[f"{fmt}-{quantize}-{lead[1]}"] = bool(torch.equal(ring, want_ring) and torch.equal(
                    got, plain(kv, weight, EPS, rot, quantize)))
    return results


def _triton_write(ring, slots, fmt, kv, weight, eps, rot, quantize):
    from dsflash_compile.custom_ops.kv_norm_rope_triton import kv_norm_rope_triton

    return kv_norm_rope_triton(kv, weight, eps, rot, quantize, ring=ring, slots=slots, fmt=fmt)


def joint_writes(write, joint, device="cpu") -> dict:
    """ring_writes for a qkv_norm_rope_write_ implementation `write` (kv's rows against `joint`, qkv_norm_rope's):
    and the query's rows equal too."""
    results = {}

    def kv_side(ring, slots, fmt, kv, weight, eps, rot, quantize):
        q, q_weight = query_inputs(kv.shape[:-1], device=device)
        qr, out = write(ring, slots, fmt, q, q_weight, kv, weight, eps, rot, quantize)
        results[len(results)] = torch.equal(qr, joint(q, q_weight, kv, weight, eps, rot, quantize)[0])
        return out

    def plain(kv, weight, eps, rot, quantize):
        return joint(*query_inputs(kv.shape[:-1], device=device), kv, weight, eps, rot, quantize)[1]

    rings = ring_writes(kv_side, plain, device)
    return {name: same and all(results.values()) for name, same in rings.items()}


def _triton_joint_write(ring, slots, fmt, q, q_weight, kv, weight, eps, rot, quantize):
    from dsflash_compile.custom_ops.kv_norm_rope_triton import qkv_norm_rope_triton

    return qkv_norm_rope_triton(q, q_weight, kv, weight, eps, rot, quantize, ring, slots, fmt)


def interpreter_checks():
    """Entry point of the subprocess."""
    from dsflash_compile.custom_ops.kv_norm_rope_triton import kv_norm_rope_triton, qkv_norm_rope_triton

    for name, same in ring_writes(_triton_write, kv_norm_rope_triton).items():
        report(dict(name=f"ring_{name}", same=same))
    for name, same in joint_writes(_triton_joint_write, qkv_norm_rope_triton).items():
        report(dict(name=f"joint_ring_{name}", same=same))

    for name, (ulps, same) in compare(kv_norm_rope_triton).items():
        report(dict(name=name, ulps=ulps, same=same))
    for name, (ulps, same) in compare_joint(qkv_norm_rope_triton, kv_norm_rope_triton).items():
        report(dict(name=f"joint_{name}", ulps=ulps, same=same))
    for name, case in CASES.items():  # the rotation loaded with the row (ROT_FIRST): the same bits
        kv, weight, rot = case_inputs(*case)
        report(dict(name=f"rot_first_{name}", same=all(
            torch.equal(kv_norm_rope_triton(kv, weight, EPS, rot, quantize, rot_first=True),
                        kv_norm_rope_triton(kv, weight, EPS, rot, quantize, rot_first=False))
            for quantize in (False, True))))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_kv_norm_rope", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    result = interpreted[name]
    assert result["ulps"] <= 1 and result["same"], result


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_rotation_loaded_first_gives_the_same_bits(interpreted, name):
    assert interpreted[f"rot_first_{name}"]["same"]


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_joint_kernel_adds_the_query_norm(interpreted, name):
    """dsflash::qkv_norm_rope's kernel: kv's bits as the kernel alone, the query within one bf16 ulp."""
    result = interpreted[f"joint_{name}"]
    assert result["ulps"] <= 1 and result["same"], result


RING_NAMES = [f"{fmt}-{quantize}-{seq}" for fmt in ("bf16", "bf16-u8", "fp8") for quantize in (False, True)
              for seq in (1, 3)]


@requires_interpreter
@pytest.mark.parametrize("name", RING_NAMES)
def test_kernel_writes_the_ring(interpreted, name):
    """kv_norm_rope_write_'s kernel (RING): the rows of the kernel without the ring, and the ring's bytes as
    record_write_'s reference writes those rows (slot -1 skipped, every other byte kept); bf16 rings (bf16 or uint8)
    and fp8, decode rows and a row of three tokens. qkv_norm_rope_write_'s the same, its query rows as without."""
    assert interpreted[f"ring_{name}"]["same"] and interpreted[f"joint_ring_{name}"]["same"]


def test_ring_write_op_reference_opcheck_and_errors():
    ring, slots, kv, weight, rot = ring_case("fp8")
    before = ring.clone()
    out = torch.ops.dsflash.kv_norm_rope_write_(ring, slots, "fp8", kv, weight, EPS, rot, True)
    assert torch.equal(out, torch.ops.dsflash.kv_norm_rope(kv, weight, EPS, rot, True))
    written = before.clone()
    torch.ops.dsflash.record_write_(written, out, slots, "fp8")
    assert torch.equal(ring, written) and not torch.equal(ring, before)
    torch.library.opcheck(torch.ops.dsflash.kv_norm_rope_write_.default, (ring, slots, "fp8", kv, weight, EPS, rot,
                                                                          True))
    with pytest.raises(ValueError, match="cache rows have 528"):
        torch.ops.dsflash.kv_norm_rope_write_(ring, slots, "bf16", kv, weight, EPS, rot, True)
    with pytest.raises(ValueError, match="slots"):
        torch.ops.dsflash.kv_norm_rope_write_(ring, slots[:1], "fp8", kv, weight, EPS, rot, True)


def test_joint_ring_write_op_reference_and_opcheck():
    ring, slots, kv, weight, rot = ring_case("fp8")
    q, q_weight = query_inputs(kv.shape[:-1])
    written = ring.clone()
    qr, out = torch.ops.dsflash.qkv_norm_rope_write_(ring, slots, "fp8", q, q_weight, kv, weight, EPS, rot, True)
    want_qr, want = torch.ops.dsflash.qkv_norm_rope(q, q_weight, kv, weight, EPS, rot, True)
    torch.ops.dsflash.record_write_(written, want, slots, "fp8")
    assert torch.equal(qr, want_qr) and torch.equal(out, want) and torch.equal(ring, written)
    torch.library.opcheck(torch.ops.dsflash.qkv_norm_rope_write_.default,
                          (ring, slots, "fp8", q, q_weight, kv, weight, EPS, rot, True))


def test_joint_op_reference_opcheck_and_errors():
    kv, weight, rot = case_inputs(*CASES["chunk"])
    q, q_weight = query_inputs(CASES["chunk"][0])
    op = torch.ops.dsflash.qkv_norm_rope
    qr, got = op(q, q_weight, kv, weight, EPS, rot, True)
    assert torch.equal(qr, rms_norm(q, q_weight, EPS)) and qr.is_contiguous()
    assert torch.equal(got, torch.ops.dsflash.kv_norm_rope(kv, weight, EPS, rot, True))
    torch.library.opcheck(op.default, (q, q_weight, kv, weight, EPS, rot, True))
    with pytest.raises(TypeError, match="q and q_weight must be bf16"):
        op(q.float(), q_weight, kv, weight, EPS, rot, True)
    with pytest.raises(ValueError, match="must be"):
        op(q[:1], q_weight, kv, weight, EPS, rot, True)
    with pytest.raises(ValueError, match="must be"):
        op(q, q_weight[:64], kv, weight, EPS, rot, True)


def test_opcheck_and_errors():
    kv, weight, rot = case_inputs(*CASES["chunk"])
    for quantize in (True, False):
        torch.library.opcheck(torch.ops.dsflash.kv_norm_rope.default, (kv, weight, EPS, rot, quantize))
    # after (never read) and early (the kernel's EARLY) change nothing on the CPU
    torch.library.opcheck(torch.ops.dsflash.kv_norm_rope.default, (kv, weight, EPS, rot, True, kv * 2, True))
    op = torch.ops.dsflash.kv_norm_rope
    with pytest.raises(TypeError, match="must be bf16 and rot fp32"):
        op(kv.float(), weight, EPS, rot, True)
    with pytest.raises(ValueError, match=r"weight has shape \(256,\)"):
        op(kv, weight[:256], EPS, rot, True)
    with pytest.raises(ValueError, match="rot has shape"):
        op(kv, weight, EPS, rot[:1], True)
    with pytest.raises(ValueError, match="multiple of the FP8 group"):
        op(kv[..., :48], weight[:48], EPS, rot[..., :8, :], True)


_KERNEL = dict(kv_ptr="*bf16", w_ptr="*bf16", rot_ptr="*fp32", out_ptr="*bf16", row_stride="i32", eps="fp32")
_RING = dict(ring_ptr="*bf16", slots_ptr="*bf16", seq="i32", ring_slots="i32", ring_sb="i32", ring_sn="i32",
             slots_sb="i32", slots_ss="i32")  # (no ring: the launch passes the rows)


@pytest.mark.parametrize("early, rot_first, ring", [(False, False, -1), (True, False, -1), (False, True, -1),
                                                    (False, False, 0), (False, False, 1)])
def test_kernel_compiles_for_hopper_without_spills(early, rot_first, ring):
    """The release row (512 values, 32 rotated pairs, FP8) at its launch's 4 warps, waiting first or (EARLY)
    working before its wait; with ROT_FIRST every load comes before the norm's first barrier; writing a bf16 or an
    fp8 ring (RING 0 / 1) as well."""
    from dsflash_compile.custom_ops import kv_norm_rope_triton as module

    args = {**_KERNEL, **_RING, **({} if ring < 0 else dict(ring_ptr=("*bf16", "*u8")[ring], slots_ptr="*i64"))}
    spec = ("_kv_norm_rope_kernel", args, dict(D=512, PAIRS=32, QUANT=True, EARLY=early, ROT_FIRST=rot_first,
                                               RING=ring), 4)
    aligned = ("kv_ptr", "w_ptr", "rot_ptr", "out_ptr", "row_stride")  # as the release's launch specializes them
    check_compiles_for_hopper(module, spec, divisible_by_16=aligned)
    ptx = compile_for_hopper(module, spec, divisible_by_16=aligned).asm["ptx"].splitlines()
    loads = [n for n, line in enumerate(ptx) if "ld.global" in line]
    first_barrier = next(n for n, line in enumerate(ptx) if "bar.sync" in line)
    assert (max(loads) < first_barrier) == rot_first


def test_joint_kernel_compiles_for_hopper_without_spills():
    """The release's rows (kv 512 values with 32 rotated pairs and FP8, the query's 1280) at the launch's 4 warps,
    with and without an fp8 ring to write."""
    from dsflash_compile.custom_ops import kv_norm_rope_triton as module

    args = dict(_KERNEL, q_ptr="*bf16", q_w_ptr="*bf16", q_out_ptr="*bf16", kv_rows="i32", q_row_stride="i32")
    args = {k: args[k] for k in ("kv_ptr", "w_ptr", "rot_ptr", "out_ptr", "q_ptr", "q_w_ptr", "q_out_ptr", "kv_rows",
                                 "row_stride", "q_row_stride", "eps")}
    for ring in (-1, 1):  # without the ring, and writing an fp8 one
        ring_args = {**_RING, **({} if ring < 0 else dict(ring_ptr="*u8", slots_ptr="*i64"))}
        check_compiles_for_hopper(module, ("_qkv_norm_rope_kernel", {**args, **ring_args},
                                           dict(D=512, PAIRS=32, QUANT=True, Q_D=1280, Q_PAD=2048, RING=ring), 4))


@requires_cuda
def test_ring_write_on_cuda():
    """kv_norm_rope_write_ and qkv_norm_rope_write_ on the GPU: the ring's bytes and the rows as the reference's
    (module notes)."""
    results = ring_writes(torch.ops.dsflash.kv_norm_rope_write_, torch.ops.dsflash.kv_norm_rope, device="cuda")
    assert all(results.values()), results
    results = joint_writes(torch.ops.dsflash.qkv_norm_rope_write_, torch.ops.dsflash.qkv_norm_rope, device="cuda")
    assert all(results.values()), results


@requires_cuda
def test_joint_kernel_on_cuda():
    for name, (ulps, same) in compare_joint(torch.ops.dsflash.qkv_norm_rope, torch.ops.dsflash.kv_norm_rope,
                                            device="cuda").items():
        assert ulps <= 1 and same, (name, ulps)


@requires_cuda
def test_kernel_on_cuda_and_in_a_cuda_graph():
    """The GPU's code (its own rsqrt, FMAs): the properties above (also with the rotation loaded first), and a CUDA
    graph replay on new inputs."""
    from dsflash_compile.custom_ops.kv_norm_rope_triton import kv_norm_rope_triton

    for run in (torch.ops.dsflash.kv_norm_rope, functools.partial(kv_norm_rope_triton, rot_first=True)):
        for name, (ulps, same) in compare(run, device="cuda").items():
            assert ulps <= 1 and same, (name, ulps)
    kv, weight, rot = case_inputs(*CASES["decode_release"], device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.ops.dsflash.kv_norm_rope(kv, weight, EPS, rot, True)  # compiles the kernel outside the capture
    with torch.cuda.graph(graph):
        out = torch.ops.dsflash.kv_norm_rope(kv, weight, EPS, rot, True)
    fresh = case_inputs(*CASES["decode_release"], seed=1, device="cuda")
    kv.copy_(fresh[0])
    rot.copy_(fresh[2])
    graph.replay()
    assert torch.equal(out, torch.ops.dsflash.kv_norm_rope(kv, weight, EPS, rot, True))


@requires_cuda
def test_early_kernel_after_a_kernel_between():
    """early=True with a kernel between the row's producer and the op (what passes/early_reads.py guarantees):
    the same bits as waiting first, eagerly and replayed in a CUDA graph."""
    kv, weight, rot = case_inputs(*CASES["decode_release"], device="cuda")

    def step(early):
        wide = kv * 1  # the producer
        between = wide.sum(-1)  # a kernel computed from it
        return torch.ops.dsflash.kv_norm_rope(wide, weight, EPS, rot, True, between, early)

    assert torch.equal(step(True), step(False))
    step(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(True)
    kv.copy_(case_inputs(*CASES["decode_release"], seed=1, device="cuda")[0])
    graph.replay()
    assert torch.equal(out, step(False))
