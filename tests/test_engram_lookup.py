"""`dsflash::engram_lookup` (custom_ops/engram_lookup.py): Engram table rows gathered and dequantized in one launch.

The Triton kernel under the interpreter and on a GPU equals the reference bit for bit over every E4M3 code (NaN
where the reference has NaN; -0 kept) and every finite UE8M0 scale byte, 2^-127 included; compiled for sm_90
without spills; opcheck and errors; EngramTable takes it when set and a compiled Engram then has no eager index."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.custom_ops.engram_lookup import engram_lookup_reference
from dsflash_compile.engram import EngramTable

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def table(rows=300, dim=256, seed=0, device="cpu"):
    """Every E4M3 byte in each row (shuffled), scales over every byte but 255 (NaN) with 0 (2^-127) and ~127 (the
    release's) first."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.stack([torch.randperm(256, generator=g) for _ in range(rows)])[:, :dim].to(torch.uint8)
    scale = torch.randint(100, 140, (rows, dim // 32), generator=g, dtype=torch.uint8)
    scale.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn).to(device), scale.view(torch.float8_e8m0fnu).to(device)


def ids_of(rows, seed=0, device="cpu"):
    return torch.randint(0, rows, (2, 3, 24), generator=torch.Generator().manual_seed(seed + 1)).to(device)


def same(a, b) -> bool:
    """Equal bits (NaN patterns aside: NaN where the other has NaN)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16)))


def interpreter_checks():
    """Entry point of the subprocess."""
    from dsflash_compile.custom_ops.engram_lookup_triton import engram_lookup_triton

    weight, scale = table()
    for name, ids in (("all_rows", torch.arange(300)), ("hash_ids", ids_of(300))):
        report(dict(name=name, same=same(engram_lookup_triton(weight, scale, ids),
                                         engram_lookup_reference(weight, scale, ids))))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_engram_lookup", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", ["all_rows", "hash_ids"])
def test_kernel_equals_reference(interpreted, name):
    assert interpreted[name]["same"]


def test_opcheck_and_errors():
    weight, scale = table(rows=40)
    codes = weight.view(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN: opcheck compares outputs with NaN != NaN
    ids = ids_of(40)
    # (opcheck's schema test compares the inputs before and after with allclose, which fp8 tensors do not have)
    torch.library.opcheck(torch.ops.dsflash.engram_lookup.default, (weight, scale, ids),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        torch.ops.dsflash.engram_lookup(weight.view(torch.uint8), scale, ids)
    with pytest.raises(ValueError, match="scale"):
        torch.ops.dsflash.engram_lookup(weight, scale[:, :4], ids)
    with pytest.raises(TypeError, match="ids"):
        torch.ops.dsflash.engram_lookup(weight, scale, ids.float())


def test_table_takes_the_op_when_set_and_compiles_without_an_eager_index():
    """EngramTable.lookup_op: the op's bits; compiled by Inductor (CPU), the graph then calls the op and no aten
    index (the scales' gather fell back to one without it)."""
    from torch._inductor.utils import run_and_get_code

    weight, scale = table(rows=64)
    module = EngramTable(64, 256)
    module.weight.data, module.scale.data = weight, scale
    ids = ids_of(64)
    want = module(ids)
    module.lookup_op = True
    assert same(module(ids), want)
    torch._dynamo.reset()
    got, code = run_and_get_code(torch.compile(module, fullgraph=True), ids)
    assert same(got, want) and "engram_lookup" in "".join(code) and "aten.index" not in "".join(code)


def test_kernel_compiles_for_hopper_without_spills():
    from dsflash_compile.custom_ops import engram_lookup_triton as module

    args = dict(weight_ptr="*u8", scale_ptr="*u8", ids_ptr="*i64", out_ptr="*bf16")
    check_compiles_for_hopper(module, ("_engram_lookup_kernel", args, dict(D=256), 1))


@requires_cuda
def test_kernel_on_cuda_and_in_a_cuda_graph():
    weight, scale = table(device="cuda")
    ids = ids_of(300, device="cuda")
    assert same(torch.ops.dsflash.engram_lookup(weight, scale, ids), engram_lookup_reference(weight, scale, ids))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsflash.engram_lookup(weight, scale, ids)
    ids.copy_(ids_of(300, seed=5, device="cuda"))
    graph.replay()
    assert same(out, engram_lookup_reference(weight, scale, ids))
