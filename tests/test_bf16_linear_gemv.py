"""`dsflash::bf16_gemv` (custom_ops/bf16_gemv.py): one row of `dsflash::bf16_linear` on a kernel with one weight
tile a program (custom_ops/bf16_linear_gemv_triton.py).

Under the interpreter against the reference (bit for bit on data whose sums are exact in fp32), split over K or
not, K not a multiple of the tile, grouped, called twice (the split counters left at zero); compiled for sm_90
without spills; which projections take it; opcheck and the one-row error; QuantLinear's choice of it; on a GPU
at the release sizes, through the op (a weight too large for the kernel on bf16_linear's), in a CUDA graph."""

import pytest
import torch
from hopper import check_compiles_for_hopper, compile_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_bf16_linear import RELEASE, case_inputs

from torch.fx.experimental.proxy_tensor import make_fx

import dsflash_compile  # noqa: F401  (registers torch.ops.dsflash.*)
from dsflash_compile.custom_ops import bf16_linear_gemv_triton as gemv
from dsflash_compile.custom_ops.bf16_linear import bf16_linear_reference
from dsflash_compile.layers import Linear, QuantLinear

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# the release's unquantized one-row projections (layers.Linear): (K, N, groups, quantize_x)
PLAIN = {"indexer_weights_proj": (5120, 32, 1, False), "indexer_wk": (512, 128, 1, False),
         "compressor_wkv": (5120, 512, 1, False)}

# name: (K per group, N, groups, quantize_x, exact data, launch overrides)
CASES = {
    "one_split": (512, 32, 1, True, True, {}),
    "splits": (3072, 48, 1, True, True, {}),  # three 1024-wide splits, three output blocks
    "ragged_k": (1280, 16, 1, True, True, {}),  # the second split is 256 wide
    "grouped": (1024, 64, 2, False, True, {}),
    "random_data": (2048, 32, 1, True, False, {}),
    "whole_rows": (3072, 48, 1, True, True, dict(block_n=4, k_chunks=3)),  # no split: 12 blocks of 4 outputs
    "chunked_splits": (1280, 16, 1, True, True, dict(block_k=512, k_chunks=2)),  # split 1: 256 of 1024 columns
    # the tiles loaded at once (AT_ONCE): wq_a+wkv's row of 5 tiles as 4096 + 1024 columns; split in 1024-wide
    # spans, the last 256 wide; x's FP8 groups and the sums across the two spans on random data
    "five_tiles_at_once": (5120, 16, 1, True, True, dict(block_n=4, k_chunks=5, at_once=True)),
    "splits_at_once": (1280, 16, 1, True, True, dict(block_k=512, k_chunks=2, at_once=True)),
    "random_at_once": (3072, 32, 1, True, False, dict(block_n=4, k_chunks=3, at_once=True)),
    # reads and sums before the PDL wait (EARLY): at the interpreter's 8 SMs the early launch of 64 outputs is the
    # default one (8 programs); of 256 x 1280 (the indexer's wq_b's K) a K loop of 5 [32, 256] tiles, 8 programs
    "early_default": (1280, 64, 1, True, True, dict(early=True)),
    "early_loop": (1280, 256, 1, True, True, dict(early=True)),
    "early_loop_random": (1280, 256, 1, True, False, dict(early=True)),
    "early_loop_grouped": (512, 256, 2, False, True, dict(early=True, block_k=128)),
    # the bf16 outputs times a constant, rounded again (out_scale: passes/linear_scale.py), one split and split
    "scaled": (5120, 32, 1, False, False, dict(out_scale=128 ** -0.5 * 32 ** -0.5)),
    "scaled_whole_rows": (3072, 48, 1, True, False, dict(block_n=4, k_chunks=3, out_scale=0.3)),
}


def interpreter_checks():
    """Entry point of the subprocess: every case's kernel against the reference; the tiles loaded at once against
    tile by tile (random data: the same sums in another order, within a bf16 ulp)."""
    for name, (k, n, groups, quantize_x, exact, launch) in CASES.items():
        x, w = case_inputs((1,), k, n, groups, exact)
        got = gemv.bf16_linear_gemv(x, w, groups, quantize_x, **launch)
        want = bf16_linear_reference(x, w, groups, quantize_x) * launch.get("out_scale", 1.0)  # a bf16 multiply
        if "out_scale" in launch:  # against the unscaled kernel's output multiplied: the same bits
            exact = torch.equal(got, gemv.bf16_linear_gemv(x, w, groups, quantize_x, **{
                **launch, "out_scale": 1.0}) * launch["out_scale"])
            report(dict(name=name + "/multiplied", same=exact))
        again = gemv.bf16_linear_gemv(x, w, groups, quantize_x, **launch)
        tiles = gemv.bf16_linear_gemv(x, w, groups, quantize_x, **{**launch, "at_once": False})
        ulps = ((got.float() - tiles.float()).abs() / tiles.float().abs().clamp(min=1e-30)).max().item() * 128
        report(dict(name=name, same=torch.equal(got, want), again=torch.equal(again, got), shape=list(got.shape),
                    err=((got - want).abs().max() / want.abs().max()).item(), tiles_ulps=ulps))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_bf16_linear_gemv", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if "out_scale" in case[-1]])
def test_scaled_outputs_are_the_multiplied_ones(interpreted, name):
    assert interpreted[name + "/multiplied"]["same"]


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    result, (_, n, _, _, exact, _) = interpreted[name], CASES[name]
    assert result["shape"] == [1, n] and result["again"] and result["tiles_ulps"] <= 1, result
    if exact:
        assert result["same"], result
    else:  # another summation order can move a bf16 rounding
        assert result["err"] <= 1e-2, result


def test_which_projections_take_it():
    """One row, 16-wide output blocks per group, at most MAX_BYTES_PER_SM a SM (132 SMs: of the release's
    projections wq_a+wkv and the indexer's wq_b, not wq_b, wo_a, wo_b)."""
    def takes(name, rows=1):
        k, n, groups, _ = RELEASE[name]
        return gemv.takes(rows, n, k, groups, sms=132)

    assert [name for name in RELEASE if takes(name)] == ["wq_a+wkv", "indexer_wq_b"]
    assert not takes("wq_a+wkv", rows=2)
    assert not gemv.takes(1, 40, 1024, 1, sms=None)  # 40 outputs: no 16-wide blocks
    assert gemv.takes(1, 48, 1 << 20, 1, sms=None)  # the interpreter: any size


def test_opcheck_and_one_row_only():
    x, w = case_inputs((1, 1), 64, 32, 2, True)
    for quantize in (True, False):
        torch.library.opcheck(torch.ops.dsflash.bf16_gemv.default, (x, w, 2, quantize))
    torch.library.opcheck(torch.ops.dsflash.bf16_gemv.default, (x, w, 2, True), dict(out_scale=0.25))
    assert torch.equal(torch.ops.dsflash.bf16_gemv(x, w, 2, True, out_scale=0.3),
                       torch.ops.dsflash.bf16_gemv(x, w, 2, True) * 0.3)
    after = torch.zeros(3)  # passes/early_reads.py's: an ordering input, never read
    torch.library.opcheck(torch.ops.dsflash.bf16_gemv.default, (x, w, 2, True), dict(after=after, early=True))
    assert torch.equal(torch.ops.dsflash.bf16_gemv(x, w, 2, True, after=after, early=True),
                       torch.ops.dsflash.bf16_gemv(x, w, 2, True))
    with pytest.raises(ValueError, match="one row only"):
        torch.ops.dsflash.bf16_gemv(torch.cat([x, x]), w, 2, True)
    with pytest.raises(TypeError, match="must be bf16"):  # bf16_linear's checks
        torch.ops.dsflash.bf16_gemv(x.float(), w, 2, True)
    with pytest.raises(ValueError, match="block_n=32 must divide a group's 16 outputs"):  # a sweep's launch
        gemv.bf16_linear_gemv(x, w, 2, True, block_n=32)


@torch.no_grad()
def test_quantlinear_takes_it_for_one_row_when_set():
    """With few_rows and gemv set (compile() sets both) one row runs bf16_gemv, more rows bf16_linear; the
    same bits as the plain path (CPU: the reference)."""
    torch.manual_seed(0)
    linear = QuantLinear(64, 96)
    torch.nn.init.normal_(linear.weight, std=0.05)
    xs = {rows: torch.randn(rows, 64).bfloat16() for rows in (1, 2)}
    plain = {rows: linear(x) for rows, x in xs.items()}
    linear.few_rows, linear.gemv = 4, True
    for rows, x in xs.items():
        ops = {node.target for node in make_fx(linear)(x).graph.nodes if node.op == "call_function"}
        want = torch.ops.dsflash.bf16_gemv.default if rows == 1 else torch.ops.dsflash.bf16_linear.default
        assert want in ops, ops
        assert torch.equal(linear(x), plain[rows])


@torch.no_grad()
def test_plain_linear_takes_it_for_one_row_when_set():
    """layers.Linear with gemv set (compile() sets it): one bf16 row runs bf16_gemv without the FP8 of the input,
    more rows F.linear, fp32 weights (the ratio > 1 compressor) not bf16_gemv (test_fp32_gemv.py: fp32_gemv); the
    same bits as F.linear (CPU: the reference)."""
    torch.manual_seed(0)
    linear, fp32 = Linear(64, 32), Linear(64, 32, dtype=torch.float32)
    xs = {rows: torch.randn(rows, 64).bfloat16() for rows in (1, 2)}
    plain = {rows: linear(x) for rows, x in xs.items()}
    linear.gemv = fp32.gemv = True
    for rows, x in xs.items():
        ops = {node.target for node in make_fx(linear)(x).graph.nodes if node.op == "call_function"}
        assert (torch.ops.dsflash.bf16_gemv.default in ops) == (rows == 1), ops
        assert torch.equal(linear(x), plain[rows])
    ops = {node.target for node in make_fx(fp32)(xs[1]).graph.nodes if node.op == "call_function"}
    assert torch.ops.dsflash.bf16_gemv.default not in ops


@pytest.mark.parametrize("at_once", [False, True])
@pytest.mark.parametrize("whole_rows", [False, True])
@pytest.mark.parametrize("quantize", [True, False])
def test_compiles_for_hopper_without_spills(quantize, whole_rows, at_once):
    """Both default launches (wq_a+wkv's whole rows of 5 tiles, K split in tiles) without spills on sm_90, tile by
    tile and loaded at once (AT_ONCE: then every weight load comes before the first barrier)."""
    launch = gemv.launch(1792, 5120, 1, 132) if whole_rows else gemv.launch(32, 5120, 1, 132)
    assert launch["k_chunks"] == (5 if whole_rows else 1) and not gemv.early_launch(1792, 5120, 1, 132)["loop"]
    args = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32", N="i32",
                K="i32", n_per_group="i32")
    head, tail = gemv.spans(launch["k_chunks"] * launch["block_k"]) if at_once else (0, 0)
    constexprs = dict(QUANT_X=quantize, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"],
                      K_CHUNKS=launch["k_chunks"], NORM=False, HEAD=head, TAIL=tail, EARLY=False, LOOP=False, SCALED=False)
    spec = ("_gemv_kernel", args, constexprs, launch["num_warps"])
    check_compiles_for_hopper(gemv, spec, divisible_by_16=("x_ptr", "w_ptr", "K"))
    ptx = compile_for_hopper(gemv, spec, divisible_by_16=("x_ptr", "w_ptr", "K")).asm["ptx"]
    weight_loads = [i for i, line in enumerate(ptx.splitlines()) if "ld.global.v4" in line]
    first_barrier = next(i for i, line in enumerate(ptx.splitlines()) if "bar.sync" in line)
    assert (max(weight_loads) < first_barrier) == (at_once and whole_rows or launch["k_chunks"] == 1), at_once


def test_early_launch_keeps_to_one_program_an_sm():
    """An early launch (beside the kernel before it) is the default one where that has no more programs than SMs
    (weights_proj's 32 outputs: 2 x 5 splits), else whole rows in a K loop of at most EARLY_MAX_TILES tiles (the
    indexer's wq_b: 128 programs of 32 outputs, 5 tiles of 256), else the default (wq_a+wkv: 10 tiles a row)."""
    assert gemv.early_launch(32, 5120, 1, 132) == dict(gemv.launch(32, 5120, 1, 132), loop=False)
    assert gemv.early_launch(4096, 1280, 1, 132) == dict(block_n=32, block_k=256, num_warps=4, k_chunks=5, loop=True)
    assert gemv.early_launch(1792, 5120, 1, 132) == dict(gemv.launch(1792, 5120, 1, 132), loop=False)
    assert gemv.early_launch(256, 1280, 1, 8)["loop"]  # the interpreter's cases
    assert not gemv.early_launch(48, 1280, 2, 8)["loop"]  # 24 outputs a group: no 32-row block divides them


@pytest.mark.parametrize("quantize", [True, False])
def test_early_loop_compiles_for_hopper_without_spills(quantize):
    """The indexer's wq_b's early launch (a K loop of [32, 256] tiles, one stage: no shared memory; with an output
    scale) without spills on sm_90; in its PTX every load of x and the weight comes before the PDL wait (griddepcontrol.wait; after it
    only a split finish's reads of the partials, ld.global.cg), every store and atomic after it, and the next kernel
    is let in (launch_dependents) only after the wait."""
    launch = gemv.early_launch(4096, 1280, 1, 132)
    args = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32", N="i32",
                K="i32", n_per_group="i32", scale="fp32")
    constexprs = dict(QUANT_X=quantize, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"],
                      K_CHUNKS=launch["k_chunks"], NORM=False, HEAD=0, TAIL=0, EARLY=True, LOOP=True, SCALED=True)
    spec = ("_gemv_kernel", args, constexprs, launch["num_warps"], 1)
    check_compiles_for_hopper(gemv, spec, divisible_by_16=("x_ptr", "w_ptr", "K"))
    lines = compile_for_hopper(gemv, spec, divisible_by_16=("x_ptr", "w_ptr", "K")).asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    release = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
    loads = [i for i, line in enumerate(lines) if "ld.global" in line and "ld.global.cg" not in line]
    stores = [i for i, line in enumerate(lines) if "st.global" in line or "atom.global" in line]
    assert loads and stores and max(loads) < wait < release < min(stores), (max(loads), wait, release, min(stores))


def test_default_launch_takes_whole_rows_for_long_rows_only():
    """Whole rows for wq_a+wkv (5 tiles of K, 448 programs of 4 outputs), split tiles for the indexer's wq_b
    (2 tiles) and the plain projections with few outputs."""
    assert gemv.launch(1792, 5120, 1, 132) == dict(block_n=4, block_k=1024, num_warps=8, k_chunks=5)
    for n, k in [(4096, 1280), (32, 5120), (512, 5120), (1792, 9216)]:
        assert gemv.launch(n, k, 1, 132)["k_chunks"] == 1, (n, k)


# ----------------------------------------------------------------------------------------------- CUDA

@requires_cuda
@pytest.mark.parametrize("name", ["wq_a+wkv", "indexer_wq_b", "wo_b", *PLAIN])
def test_release_sizes_on_cuda(name):
    """Against the reference (cuBLAS: another summation order), also with the tiles loaded at once, the op taking
    this kernel (wo_b, too large for it: bf16_linear's bits), and replayed in a CUDA graph on new x."""
    k, n, groups, quantize = RELEASE[name] if name in RELEASE else PLAIN[name]
    x, w = case_inputs((1,), k, n, groups, False, device="cuda")
    if not gemv.fits(x, w, groups):
        assert name == "wo_b"
        assert torch.equal(torch.ops.dsflash.bf16_gemv(x, w, groups, quantize),
                           torch.ops.dsflash.bf16_linear(x, w, groups, quantize))
        return
    got = gemv.bf16_linear_gemv(x, w, groups, quantize)
    want = bf16_linear_reference(x, w, groups, quantize)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-2
    assert torch.equal(torch.ops.dsflash.bf16_gemv(x, w, groups, quantize), got)
    at_once = gemv.bf16_linear_gemv(x, w, groups, quantize, at_once=True)  # the same sums in another order
    assert ((at_once - want).abs().max() / want.abs().max()).item() <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dsflash.bf16_gemv(x, w, groups, quantize)
    x.copy_(case_inputs((1,), k, n, groups, False, seed=1, device="cuda")[0])
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, gemv.bf16_linear_gemv(x, w, groups, quantize))


@requires_cuda
def test_early_after_the_attentions_wq_b_on_cuda():
    """The indexer's wq_b with early=True after the attention's wq_b on the same row, as passes/early_reads.py sets
    it up (the row written two kernels before it), eager and replayed in a CUDA graph on a new row: the same values
    as early=False (its own launch, summed in another order: within a bf16 ulp)."""
    k, n, groups, quantize = RELEASE["indexer_wq_b"]
    x, w = case_inputs((1,), k, n, groups, False, device="cuda")
    big = case_inputs((1,), *RELEASE["wq_b"][:3], False, seed=2, device="cuda")[1]

    def chain(early):
        row = x * 1  # the row's producer
        q = torch.ops.dsflash.bf16_gemv(row, big, 1, quantize)  # the anchor: TMA-sized, it streams 84 MB
        return q, torch.ops.dsflash.bf16_gemv(row, w, groups, quantize, after=q, early=early)

    want = chain(False)[1]
    got = chain(True)[1]
    assert ((got.float() - want.float()).abs() <= want.float().abs() / 128 + 1e-30).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(True)[1]
    x.copy_(case_inputs((1,), k, n, groups, False, seed=1, device="cuda")[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, chain(True)[1])
    assert not torch.equal(captured, got)  # the replay read the new row
