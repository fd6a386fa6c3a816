"""The attention seam's RMSNorm in the wq_a+wkv GEMV (issue 5): `dsflash::bf16_gemv`'s `norm_weight` (its kernel's
NORM prologue, custom_ops/bf16_linear_gemv_triton.py), the deferred seam's `norm=False`
(custom_ops/mhc_deferred.py) and the pass that pairs them (passes/seam_norm_gemv.py).

The kernel under the interpreter against the op's reference (the sum of squares adds in another order, so within
a GEMM's tolerance); the op's checks and opcheck; the pass on a compiled seam -> GEMV (matched and rewritten nodes,
the outputs equal to eager on the CPU, where both references norm alike); compiled for sm_90 without spills; on a
GPU at the release's sizes."""

import pytest
import torch
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted
from test_bf16_linear import case_inputs
from test_compile import fresh_dynamo, tiny_model  # noqa: F401  (fresh_dynamo: a fixture)
from test_mhc_fusion import NORM_EPS, seam_args
from torch._inductor import config as inductor_config

import dsflash_compile
from dsflash_compile import passes
from dsflash_compile.custom_ops.bf16_gemv import gemv_reference
from dsflash_compile.passes import DsflashPassManager, SeamNormGemvPass

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ops = torch.ops.dsflash

# name: (K, N, quantize_x, launch overrides: whole rows)
CASES = {
    "three_tiles": (3072, 48, True, dict(block_n=4, block_k=1024, k_chunks=3)),
    "ragged_tile": (1280, 32, False, dict(block_n=8, block_k=512, k_chunks=3)),  # the last tile 256 of 512 wide
    # the tiles loaded at once (AT_ONCE): 2048 + 1024 columns; 1024 + 512, the last 256 masked
    "three_tiles_at_once": (3072, 48, True, dict(block_n=4, block_k=1024, k_chunks=3, at_once=True)),
    "ragged_at_once": (1280, 32, False, dict(block_n=8, block_k=512, k_chunks=3, at_once=True)),
}


def norm_inputs(k, n, seed=0, device="cpu"):
    x, w = case_inputs((1,), k, n, 1, exact=False, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed + 3)
    return x * 8, w, (torch.rand(k, generator=g) + 0.5).bfloat16().to(device)


def interpreter_checks():
    """Entry point of the subprocess: the kernel with its norm against the reference."""
    from dsflash_compile.custom_ops.bf16_linear_gemv_triton import bf16_linear_gemv

    for name, (k, n, quantize, launch) in CASES.items():
        x, w, g = norm_inputs(k, n)
        got = bf16_linear_gemv(x, w, 1, quantize, **launch, norm_weight=g, eps=NORM_EPS)
        want = gemv_reference(x, w, 1, quantize, norm_weight=g, norm_eps=NORM_EPS)
        report(dict(name=name, shape=list(got.shape), err=((got - want).abs().max() / want.abs().max()).item()))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_seam_norm_gemv", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_norms_its_row(interpreted, name):
    result, (_, n, _, _) = interpreted[name], CASES[name]
    assert result["shape"] == [1, n] and result["err"] <= 1e-2, result


def test_op_reference_opcheck_and_errors():
    x, w, g = norm_inputs(256, 32)
    normed = ops.bf16_gemv(x, w, 1, True, None, 0, g, NORM_EPS)
    from dsflash_compile.custom_ops.mhc import rms_norm
    assert torch.equal(normed, ops.bf16_gemv(rms_norm(x, g, NORM_EPS), w, 1, True))
    torch.library.opcheck(ops.bf16_gemv.default, (x, w, 1, True, None, 0, g, NORM_EPS))
    with pytest.raises(ValueError, match="norm_weight must be bf16 \\(256,\\) with groups=1"):
        ops.bf16_gemv(x, w, 1, True, None, 0, g[:128], NORM_EPS)
    with pytest.raises(ValueError, match="groups=2"):
        ops.bf16_gemv(x, w[:, :128], 2, True, None, 0, g, NORM_EPS)
    kernels = pytest.importorskip("dsflash_compile.custom_ops.bf16_linear_gemv_triton")
    with pytest.raises(ValueError, match="whole rows a program"):  # K split in two: no program holds the row
        kernels.bf16_linear_gemv(x, w, 1, True, block_k=128, k_chunks=1, norm_weight=g)


# -- the pass --------------------------------------------------------------------------------------

class Counting(DsflashPassManager):
    def __init__(self):
        super().__init__([SeamNormGemvPass()])
        self.seams, self.gemvs = [], []

    def __call__(self, graph):
        super().__call__(graph)
        self.seams += [n.args[8:] for n in graph.find_nodes(op="call_function", target=ops.mhc_seam_partials.default)]
        self.gemvs += [len(n.args) for n in graph.find_nodes(op="call_function", target=ops.bf16_gemv.default)]


def seam_then_gemv(out, streams, post, comb, pre_lagged, fn, weight, w):
    new, normed, partials = ops.mhc_seam_partials(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS)
    return new, ops.bf16_gemv(normed.view(1, -1), w, 1, True), partials


def seam_read_twice(out, streams, post, comb, pre_lagged, fn, weight, w):
    new, normed, partials = ops.mhc_seam_partials(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS)
    return new, ops.bf16_gemv(normed.view(1, -1), w, 1, True), normed.sum()


@pytest.mark.parametrize("fn, moved", [(seam_then_gemv, 1), (seam_read_twice, 0)])
def test_pass_moves_the_norm_into_the_gemv(fresh_dynamo, fn, moved):  # noqa: F811
    out, streams, post, comb, pre_lagged, mix_fn, _, _, weight = seam_args((1,), dim=64)
    w = case_inputs((1,), 64, 32, 1, exact=False)[1]
    args = (out, streams, post, comb, pre_lagged, mix_fn, weight, w)
    manager = Counting()
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):
        passes.use(manager)
        got = torch.compile(fn, fullgraph=True)(*args)
        passes.use(None)
    assert manager.matches == {"seam_norm_gemv": moved}
    assert manager.seams == [(False,) if moved else ()] and manager.gemvs == [8 if moved else 4]
    for g, r in zip(got, fn(*args)):
        assert torch.equal(g, r)  # on the CPU both references norm the same collapse alike


def test_compile_option_installs_the_pass(fresh_dynamo):  # noqa: F811
    def installed(**options):
        dsflash_compile.compile(tiny_model(), max_batch=2, max_length=32, backend="eager", **options)
        return any(isinstance(p, SeamNormGemvPass) for p in inductor_config.post_grad_custom_post_pass.passes)

    assert installed(seam_norm_gemv=True) and not installed()  # off by default: not measured yet
    assert not installed(seam_norm_gemv=True, mhc_defer_mixes=False)  # it rewrites the deferred seams


@pytest.mark.parametrize("at_once", [False, True])
def test_kernel_compiles_for_hopper_without_spills(at_once):
    """wq_a+wkv's default launch (whole rows: 4 outputs x 5 tiles of 1024, 8 warps) with the norm prologue, tile
    by tile and loaded at once (AT_ONCE: 4096 + 1024 columns)."""
    from dsflash_compile.custom_ops import bf16_linear_gemv_triton as module

    launch = module.launch(1792, 5120, 1, 132)
    args = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32",
                norm_w_ptr="*bf16", N="i32", K="i32", n_per_group="i32", eps="fp32")
    head, tail = module.spans(launch["k_chunks"] * launch["block_k"]) if at_once else (0, 0)
    constexprs = dict(QUANT_X=True, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"],
                      K_CHUNKS=launch["k_chunks"], NORM=True, HEAD=head, TAIL=tail, EARLY=False, LOOP=False, SCALED=False)
    check_compiles_for_hopper(module, ("_gemv_kernel", args, constexprs, launch["num_warps"]),
                              divisible_by_16=("x_ptr", "w_ptr", "K"))


# ----------------------------------------------------------------------------------------------- CUDA

@requires_cuda
def test_cuda_seam_then_gemv_at_release_dims():
    """D 5120, wq_a+wkv (1792 outputs): the seam without its norm then the GEMV with it, against the seam with it
    then the GEMV, within a GEMM's tolerance (the sum of squares adds in another order); the seam's other outputs
    bit-equal."""
    out, streams, post, comb, pre_lagged, fn, _, _, weight = (t.cuda() for t in seam_args((1, 1), dim=5120))
    w = case_inputs((1,), 5120, 1792, 1, exact=False, device="cuda")[1]
    new, normed, partials = ops.mhc_seam_partials(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS)
    new_u, collapsed, partials_u = ops.mhc_seam_partials(out, streams, post, comb, pre_lagged, fn, weight, NORM_EPS,
                                                         False)
    assert torch.equal(new_u, new) and torch.equal(partials_u, partials)
    want = ops.bf16_gemv(normed.view(1, -1), w, 1, True)
    got = ops.bf16_gemv(collapsed.view(1, -1), w, 1, True, None, 0, weight, NORM_EPS)
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= 1e-2
