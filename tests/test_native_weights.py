"""Native weights (issue 9): FP8 32x32-tile projections and MXFP4 routed experts held as the release stores
them, multiplied by `dsflash::fp8_block_linear` and `dsflash::mxfp4_grouped_mm` (CPU).

The ops' references dequantize exactly and multiply as the bf16 model does, so on CPU a native model gives
the bf16 model's logits bit for bit (the golden fixture's tolerance is not even needed). The Triton kernels
run here under the interpreter at small sizes (in a subprocess, see interp.py) against the references, and
are compiled for sm_90 to catch register spills; their GPU runs are in the CUDA tests at the end.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch._dynamo.utils import counters

import dsflash_compile
from dsflash_compile import DeepseekV41ForCausalLM, formats, preset_config
from dsflash_compile.checkpoint import FP8_BLOCK, MXFP4, CheckpointError, weight_format
from dsflash_compile.configuration_deepseek_v41 import ScheduleError
from dsflash_compile.layers import NativeQuantLinear, QuantLinear, hold
from dsflash_compile.moe import COUNT_ORDER_BOUND, MoE
from golden import TINY_A, fixture, load_model, requires_golden
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted

ops = torch.ops.dsflash
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def fp8_case(rows, n, k, groups=1, seed=0, device="cpu"):
    """x bf16 [rows, groups * k] and an FP8 weight [n, k] whose tiles use different scales."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(rows, groups * k, generator=g, device=device).bfloat16()
    w = torch.randn(n, k, generator=g, device=device) * k ** -0.5
    weight, scale = formats.quant_fp8_block(w * torch.rand(n, k, generator=g, device=device).mul(8).exp2())
    return x, weight, scale


def mxfp4_case(counts, n, k, seed=0, device="cpu"):
    """x bf16 [sum(counts), k] sorted by expert, stacked MXFP4 experts [E, n, k/2], offsets int32 [E]."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g, device=device).bfloat16()
    encoded = [formats.quant_mxfp4(torch.randn(n, k, generator=g, device=device) * k ** -0.5) for _ in counts]
    weight, scale = (torch.stack(t) for t in zip(*encoded))
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    return x, weight, scale, offsets


def bf16_linear(weight, groups=1, storage="fp8"):
    """The bf16 model's projection holding `weight` (dequantized)."""
    linear = QuantLinear(weight.shape[1], weight.shape[0], quantize_input=False, storage=storage, groups=groups)
    linear.weight.data = weight
    return linear


def opcheck(op, args):
    """torch.library.opcheck without its schema test, whose before/after comparison (allclose) has no float8
    kernels; that test's point, no input mutated, is checked here on the bytes instead."""
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))
    op(*args)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after))


# ----------------------------------------------------------------------------------- the references


@pytest.mark.parametrize("groups", [1, 2])
def test_fp8_block_linear_rounds_as_the_bf16_projection(groups):
    """Bit for bit the bf16 QuantLinear holding the dequantized weight (3-D activations, ragged tiles)."""
    x, weight, scale = fp8_case(7, 96, 80, groups)
    x = x.view(1, 7, -1)
    want = bf16_linear(formats.dequant_fp8_block(weight, scale), groups)(x)
    assert torch.equal(ops.fp8_block_linear(x, weight, scale, groups), want)


@pytest.mark.parametrize("groups", [1, 2])
def test_fp8_block_linear_opcheck(groups):
    opcheck(ops.fp8_block_linear.default, (*fp8_case(5, 64, 96, groups), groups))


def test_fp8_block_linear_errors_name_the_problem():
    x, weight, scale = fp8_case(3, 64, 64)
    with pytest.raises(TypeError, match="activations must be bf16"):
        ops.fp8_block_linear(x.float(), weight, scale)
    with pytest.raises(ValueError, match="do not split into groups=3"):
        ops.fp8_block_linear(x, weight, scale, 3)
    with pytest.raises(ValueError, match="x has 64 inputs"):
        ops.fp8_block_linear(x, weight, scale, 2)
    with pytest.raises(ValueError, match="scale has shape"):
        ops.fp8_block_linear(x, weight, scale[:1])


def test_mxfp4_grouped_mm_rounds_as_the_expert_loop_and_reads_only_selected_experts():
    """Each expert's rows equal the bf16 expert's F.linear bit for bit; experts without rows are never read
    (their scales poisoned with NaN change nothing); rows past the last offset are zero."""
    x, weight, scale, offsets = mxfp4_case([3, 0, 5, 0, 1], 64, 96)
    poisoned = scale.clone()
    poisoned.view(torch.uint8)[[1, 3]] = 255  # UE8M0 NaN
    got = ops.mxfp4_grouped_mm(x, weight, poisoned, offsets)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        want = bf16_linear(formats.dequant_mxfp4(weight[e], scale[e]), storage="mxfp4")(x[start:end])
        assert torch.equal(got[start:end], want), e
        start = end
    short = offsets.clone()
    short[-1] = 8  # the last row belongs to no expert
    assert torch.equal(ops.mxfp4_grouped_mm(x, weight, scale, short)[8], torch.zeros(64, dtype=torch.bfloat16))


def test_mxfp4_grouped_mm_opcheck():
    opcheck(ops.mxfp4_grouped_mm.default, mxfp4_case([2, 0, 3], 32, 64))


def bf16_case(counts, n, k, seed=0, device="cpu"):
    """x bf16 [sum(counts), k] sorted by expert, stacked bf16 experts [E, n, k], offsets int32 [E]."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g, device=device).bfloat16()
    weight = (torch.randn(len(counts), n, k, generator=g, device=device) * k ** -0.5).bfloat16()
    return x, weight, torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def test_grouped_mm_is_torch_grouped_mm_and_zeroes_rows_past_the_last_expert():
    x, weight, offsets = bf16_case([3, 0, 5, 1], 64, 96)
    want = torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    assert torch.equal(ops.grouped_mm(x, weight, offsets), want)
    short = offsets.clone()
    short[-1] = 8
    assert torch.equal(ops.grouped_mm(x, weight, short)[8], torch.zeros(64, dtype=torch.bfloat16))
    opcheck(ops.grouped_mm.default, (x, weight, offsets))
    with pytest.raises(ValueError, match="differ in K"):
        ops.grouped_mm(x[:, :32], weight, offsets)
    with pytest.raises(TypeError, match="weight bf16"):
        ops.grouped_mm(x, weight.float(), offsets)


def tiny_moe(weights="bf16") -> MoE:
    """Layer 0's MoE of the tiny preset, initialised as the model does (no model built)."""
    from dsflash_compile.init import init_module

    torch.manual_seed(0)
    text = preset_config("tiny", weights=weights).text_config
    moe = MoE(text)
    moe.apply(lambda m: init_module(m, text))
    if moe.grouped:
        moe.stack_experts()
    return moe


def count_grouped_mm(monkeypatch) -> list:
    """Calls of dsflash::grouped_mm from here on (one entry each): on CPU its bits are torch._grouped_mm's, so
    only a count tells which grouped GEMM ran."""
    calls, op = [], torch.ops.dsflash.grouped_mm
    monkeypatch.setattr(torch.ops.dsflash, "grouped_mm", lambda *args: calls.append(1) or op(*args))
    return calls


def test_grouped_mm_by_rows_picks_the_grouped_gemm_when_it_runs(monkeypatch):
    """dsflash::grouped_mm_by_rows (dynamic shapes): dsflash::grouped_mm up to few_rows rows, torch._grouped_mm
    above (the same bits on CPU: only the count tells them apart)."""
    x, weight, offsets = bf16_case([3, 0, 5, 1], 64, 96)
    want = torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    opcheck(ops.grouped_mm_by_rows.default, (x, weight, offsets, 9))
    calls = count_grouped_mm(monkeypatch)
    assert torch.equal(ops.grouped_mm_by_rows(x, weight, offsets, 9), want)
    assert len(calls) == 1
    assert torch.equal(ops.grouped_mm_by_rows(x, weight, offsets, 8), want)
    assert len(calls) == 1


@torch.no_grad()
@pytest.mark.parametrize("count_order", [0, COUNT_ORDER_BOUND])
def test_moe_few_rows_path_equals_the_expert_loop(count_order, monkeypatch):
    """compile() routes decode-sized MoE calls to dsflash::grouped_mm, their pairs ordered by argsort or by
    counting: on CPU the expert loop's bits."""
    moe = tiny_moe()
    x = torch.randn(3, 1, moe.gate.weight.shape[1]).bfloat16()
    want = moe(x)
    moe.stack_experts()
    moe.few_rows, moe.count_order = 3 * moe.gate.topk, count_order
    calls = count_grouped_mm(monkeypatch)
    sorts = argsort_runs(monkeypatch, not count_order)
    assert torch.equal(moe(x), want)
    assert len(calls) == 3  # w1, w3, w2
    assert len(sorts) == (0 if count_order else 2)  # the pairs' order and the slots' order


def argsort_runs(monkeypatch, allowed: bool) -> list:
    """Calls of Tensor.argsort from here on; a call fails the test where it is not `allowed` (the counting
    paths give argsort's results, so only this tells which path ran)."""
    calls, argsort = [], torch.Tensor.argsort

    def counted(*args, **kwargs):
        assert allowed, "argsort ran where the counting order should"
        calls.append(1)
        return argsort(*args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "argsort", counted)
    return calls


@pytest.mark.parametrize("pairs, groups", [(1, 1), (7, 9), (448, 9), (900, 385)])
def test_counting_order_is_the_stable_argsort(pairs, groups, monkeypatch):
    """MoE._expert_order by counting gives argsort(stable=True)'s order and its inverse, ties (many pairs per
    expert), empty experts and pairs keyed `groups` (no GEMM computes them) included; count_order is the
    bound on pairs x (groups + 1) past which argsort runs."""
    moe = MoE(preset_config("tiny").text_config)
    key = torch.randint(0, groups + 1, (pairs,), generator=torch.Generator().manual_seed(pairs))
    key[::5] = groups
    want = key.argsort(stable=True)
    for bound, sorts in ((pairs * (groups + 1), False), (pairs * (groups + 1) - 1, True), (0, True)):
        moe.count_order = bound
        with monkeypatch.context() as patch:
            calls = argsort_runs(patch, sorts)
            order, rank = moe._expert_order(key, groups)
        assert len(calls) == sorts
        assert torch.equal(order, want) and torch.equal(order[rank], torch.arange(pairs)), bound


def test_counting_slot_order_is_the_stable_argsort(monkeypatch):
    """MoE._slot_order by counting: each token's slots by ascending id, ties (-1, other ranks' pairs) in slot
    order, as argsort(dim=1, stable=True)."""
    moe = MoE(preset_config("tiny").text_config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(385, generator=gen)[:7] for _ in range(64)])
    ids = ids.masked_fill(torch.rand(ids.shape, generator=gen) < 0.3, -1)
    want = ids.argsort(dim=1, stable=True)
    moe.count_order = 1
    argsort_runs(monkeypatch, False)
    assert torch.equal(moe._slot_order(ids), want)


def test_counting_orders_compile_with_inductor(monkeypatch):
    """Both counting orders through Inductor (fullgraph: no graph break, no host sync) give argsort's results
    (CompileOptions.moe_count_order's default path, without a whole model)."""
    moe = MoE(preset_config("tiny").text_config)
    moe.count_order = COUNT_ORDER_BOUND
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(9, generator=gen)[:7] for _ in range(16)])
    ids = ids.masked_fill(torch.rand(ids.shape, generator=gen) < 0.2, -1)
    key = torch.where(ids >= 0, ids, 9).flatten()
    orders = torch.compile(lambda key, ids: (*moe._expert_order(key, 9), moe._slot_order(ids)), fullgraph=True)
    with monkeypatch.context() as patch:
        argsort_runs(patch, False)  # Dynamo traces the patched method: an argsort fails the trace
        order, rank, slots = orders(key, ids)
    assert torch.equal(order, key.argsort(stable=True)) and torch.equal(order[rank], torch.arange(key.numel()))
    assert torch.equal(slots, ids.argsort(dim=1, stable=True))


@torch.no_grad()
@pytest.mark.parametrize("few_rows", [0, 64])
def test_grouped_moe_computes_no_pair_marked_elsewhere(few_rows, monkeypatch):
    """ParallelMoE marks other ranks' pairs -1: the grouped GEMMs stop at the last local pair (every offset
    ends there) and the output is the expert loop's, which skips them; both grouped GEMMs."""
    moe = tiny_moe()
    moe.stack_experts()
    moe.few_rows = few_rows
    x = torch.randn(6, moe.gate.weight.shape[1]).bfloat16()
    weights, ids = moe.gate(x)
    ids = ids.masked_fill(ids % 2 == 1, -1)  # odd experts on another rank
    want = moe._routed_loop(x, weights, ids)
    grouped, rows = moe._grouped_mm, []

    def counting(xs, name, offsets):
        rows.append(int(offsets[-1]))
        return grouped(xs, name, offsets)
    monkeypatch.setattr(moe, "_grouped_mm", counting)
    calls = count_grouped_mm(monkeypatch)
    assert torch.equal(moe._routed_grouped(x, weights, ids), want)
    assert rows == [int((ids >= 0).sum())] * 3
    assert len(calls) == (3 if few_rows else 0)  # dsflash::grouped_mm or torch._grouped_mm


@torch.no_grad()
@pytest.mark.parametrize("few_rows", [0, 64])
def test_shared_expert_stacked_gives_the_same_bits_and_checkpoint(few_rows, monkeypatch):
    """stack_experts(shared=True): the shared expert as slice E of the stacks (weight 1, added last) gives the
    unstacked MoE's bits through either grouped GEMM; its tensors are views of the stacks under unchanged
    names, and unstacking gives them their own storage back."""
    moe = tiny_moe()
    x = torch.randn(5, 2, moe.gate.weight.shape[1]).bfloat16()
    want, names = moe(x), list(moe.state_dict())
    moe.stack_experts(shared=True)
    moe.few_rows = few_rows
    assert moe.w1_weight_stacked.shape[0] == len(moe.experts) + 1
    def storage(t):
        return t.untyped_storage().data_ptr()

    assert storage(moe.shared_experts.w2.weight) == storage(moe.w2_weight_stacked)
    assert list(moe.state_dict()) == names
    calls = count_grouped_mm(monkeypatch)
    assert torch.equal(moe(x), want)
    assert len(calls) == (3 if few_rows else 0)
    moe.stack_experts()
    assert storage(moe.shared_experts.w1.weight) != storage(moe.w1_weight_stacked)
    assert moe.w1_weight_stacked.shape[0] == len(moe.experts)
    assert torch.equal(moe(x), want)
    with pytest.raises(ValueError, match="bf16 MoE"):
        MoE(preset_config("tiny", weights="native").text_config).stack_experts(True)


@torch.no_grad()
@pytest.mark.parametrize("weights", ["bf16", "native"])
def test_fused_input_projections_give_the_same_logits_and_checkpoint(weights):
    """Attention.fuse_input_projections: wq_a and wkv as one projection give the same logits; their tensors
    are views of the fused ones under unchanged names (also after a move), and unfusing runs two again."""
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(preset_config("tiny", weights=weights)).eval()
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    want, names = model(ids).logits, list(model.state_dict())
    for layer in model.model.layers:
        layer.attn.fuse_input_projections()
    model._apply(torch.clone)
    attn = model.model.layers[0].attn
    for leaf in ("weight", "scale") if weights == "native" else ("weight",):
        fused = getattr(attn.wqkv_a, leaf).untyped_storage().data_ptr()
        assert all(getattr(m, leaf).untyped_storage().data_ptr() == fused for m in (attn.wq_a, attn.wkv))
    assert list(model.state_dict()) == names
    assert torch.equal(model(ids).logits, want)  # on CPU each output's dot product is the same
    held = attn.wqkv_a
    attn.fuse_input_projections()  # a second compile(): graphs captured by the first still read these tensors
    assert attn.wqkv_a is held
    hold(attn.wkv, "weight", attn.wkv.weight.clone())  # as a load with assign=True: wkv's own tensor again
    attn.fuse_input_projections()  # fuses anew, so the GEMV reads the loaded tensor
    fused = attn.wqkv_a.weight.untyped_storage().data_ptr()
    assert attn.wqkv_a is not held and attn.wkv.weight.untyped_storage().data_ptr() == fused
    for layer in model.model.layers:
        layer.attn.fuse_input_projections(False)
    assert all(layer.attn.wqkv_a is None for layer in model.model.layers)  # two projections run again
    assert torch.equal(model(ids).logits, want)


def test_mxfp4_grouped_mm_errors_name_the_problem():
    x, weight, scale, offsets = mxfp4_case([2, 1], 32, 64)
    with pytest.raises(ValueError, match="offsets must be int32"):
        ops.mxfp4_grouped_mm(x, weight, scale, offsets.long())
    with pytest.raises(ValueError, match="do not fit"):
        ops.mxfp4_grouped_mm(x[:, :32], weight, scale, offsets)
    with pytest.raises(TypeError, match="weight must be int8"):
        ops.mxfp4_grouped_mm(x, weight.view(torch.uint8), scale, offsets)


# ------------------------------------------------------------------------------ the Triton kernels

# name: (rows, outputs, inputs, groups, launch keywords); every launch of scripts/sweep_native.py's grid once
FP8_CASES = {
    "decode_one_token": (1, 64, 256, 1, {}),
    "ragged_rows_and_inputs": (19, 96, 200, 1, {}),
    "split_k": (5, 64, 384, 1, dict(splits=3)),
    "groups": (3, 128, 64, 2, {}),
    "groups_split_k": (2, 128, 384, 2, dict(splits=3)),
    "block_m_64": (33, 32, 64, 1, dict(splits=1, block_m=64)),
    "block_n_32_uneven_split": (2, 64, 640, 1, dict(block_n=32, splits=2)),
    "block_n_128_block_k_256": (3, 256, 768, 2, dict(block_n=128, block_k=256, num_stages=4)),
    "programs_per_sm_4": (1, 64, 1024, 1, dict(programs_per_sm=4)),
}
# name: (rows per expert, outputs, inputs, MXFP4 launch keywords); the MXFP4 and the bf16 kernel run each
GROUPED_CASES = {
    "decode_one_row_per_expert": ([1, 0, 1, 1, 0, 0, 1], 64, 128, {}),
    "more_rows_than_a_tile": ([17, 0, 2, 33], 96, 64, {}),
    "one_expert_ragged_inputs": ([0, 5, 0], 32, 96, {}),
    "ragged_outputs_several_k_blocks": ([2, 1], 40, 288, {}),
    "block_n_16_block_k_256": ([1, 2, 0, 1], 48, 512, dict(block_n=16, block_k=256, num_stages=4)),
    "block_n_32_warps_8": ([1, 0, 3], 64, 384, dict(block_n=32, num_warps=8)),
    # each row tile over uneven experts, one without rows (the default launch picks by rows: block_m_for)
    "block_m_16_many_rows": ([40, 0, 7, 21], 64, 128, dict(block_m=16)),
    "block_m_32": ([33, 1, 0, 40], 32, 128, dict(block_m=32)),
    "block_m_64_many_rows": ([70, 0, 3, 64], 64, 256, dict(block_m=64)),
}


# name: (rows per expert, rows past the last expert, launch keywords)
TAIL_CASES = {
    "all_rows_past": ([0, 0, 0], 40, {}),
    "every_expert_full_tail_several_tiles": ([16, 16, 16, 16, 16, 16, 16, 16], 37, dict(block_m=16)),
    "ragged_tail_block_m_16": ([1, 17, 0, 3], 33, dict(block_n=16, block_m=16)),
    "ragged_tail_block_m_32": ([33, 0, 1], 31, dict(block_m=32)),
    "ragged_tail_default_block_m_64": ([1, 65, 0, 2], 127, {}),  # 195 rows over 4 experts: block_m_for picks 64
}


@pytest.mark.parametrize("rows, experts, block_m", [
    (0, 8, 16), (48, 8, 16), (128, 8, 16), (136, 8, 32), (256, 8, 32), (264, 8, 64), (384, 8, 64), (6, 384, 16),
    (4096, 1, 64), (195, 4, 64)])
def test_block_m_for_picks_the_smallest_row_tile_over_the_mean(rows, experts, block_m):
    """16 / 32 / 64 by mean rows per expert: flash-40l-e8 at 8 tokens (48 rows) 16, at 64 tokens (384) 64."""
    pytest.importorskip("triton")
    from dsflash_compile.custom_ops.mxfp4_experts_triton import block_m_for

    assert block_m_for(rows, experts) == block_m


@pytest.mark.parametrize("tokens, block_m", [(1, 16), (8, 16), (16, 32), (32, 32), (64, 64), (128, 64)])
def test_bf16_launch_grows_the_row_tile_with_the_rows_per_expert(tokens, block_m):
    """flash-40l-e8's stacks (8 routed + the shared slice) at decode: 7 rows a token."""
    pytest.importorskip("triton")
    from dsflash_compile.custom_ops.mxfp4_experts_triton import bf16_launch

    assert bf16_launch(7 * tokens, 9)["block_m"] == block_m


def relative_error(got, want, mag) -> float:
    """Worst |got - want| relative to sum |x| |w| (the summation order moves results by about one bf16
    rounding of the larger of the two)."""
    return float(((got.float() - want.float()).abs() / mag.clamp_min(1e-30)).max())


def interpreter_checks():
    """Entry point of the subprocess: every case against the op's reference."""
    from dsflash_compile.custom_ops.fp8_linear import fp8_block_linear_reference
    from dsflash_compile.custom_ops.fp8_linear_triton import fp8_block_linear_triton
    from dsflash_compile.custom_ops.mxfp4_experts import grouped_mm_reference, mxfp4_grouped_mm_reference
    from dsflash_compile.custom_ops.mxfp4_experts_triton import grouped_mm_triton

    for name, (rows, n, k, groups, launch) in FP8_CASES.items():
        x, weight, scale = fp8_case(rows, n, k, groups)
        got = fp8_block_linear_triton(x, weight, scale, groups, **launch)
        want = fp8_block_linear_reference(x, weight, scale, groups)
        mag = fp8_block_linear_reference(x.abs(), weight.float().abs().to(torch.float8_e4m3fn), scale, groups)
        report(dict(name="fp8_" + name, err=relative_error(got, want, mag.float())))
    for name, (counts, n, k, launch) in GROUPED_CASES.items():
        x, weight, scale, offsets = mxfp4_case(counts, n, k)
        got = grouped_mm_triton(x, weight, scale, offsets, **launch)
        want = mxfp4_grouped_mm_reference(x, weight, scale, offsets)
        mag = mxfp4_grouped_mm_reference(x.abs(), weight & 0x77, scale, offsets)  # sign bits cleared: |w|
        report(dict(name="mxfp4_" + name, err=relative_error(got, want, mag.float())))
        x, weight, offsets = bf16_case(counts, n, k)
        # bf16_launch's row tile for the case's rows per expert (16, 32 or 64), ragged blocks too
        got = grouped_mm_triton(x, weight, None, offsets, block_n=32, block_k=64)
        want = grouped_mm_reference(x, weight, offsets)
        mag = grouped_mm_reference(x.abs(), weight.abs(), offsets)
        report(dict(name="bf16_" + name, err=relative_error(got, want, mag.float())))
    # rows past the last expert (ParallelMoE's pairs of other ranks): the kernel writes their zeros itself
    for name, (counts, tail, launch) in TAIL_CASES.items():
        x, weight, scale, offsets = mxfp4_case(counts + [tail], 64, 128)
        offsets, weight, scale = offsets[:-1], weight[:-1], scale[:-1]
        out = torch.full((x.shape[0], 64), float("nan"), dtype=torch.bfloat16)
        got = grouped_mm_triton(x, weight, scale, offsets, out=out, **launch)
        want = mxfp4_grouped_mm_reference(x, weight, scale, offsets)
        report(dict(name="tail_" + name, same=bool(torch.equal(got[offsets[-1]:], want[offsets[-1]:])),
                    err=relative_error(got, want, mxfp4_grouped_mm_reference(x.abs(), weight & 0x77, scale,
                                                                             offsets).float().clamp_min(1e-30))))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_native_weights", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", ["fp8_" + n for n in FP8_CASES] + [f + n for f in ("mxfp4_", "bf16_")
                                                                   for n in GROUPED_CASES])
def test_kernel_matches_reference(interpreted, name):
    assert interpreted[name]["err"] <= 2 ** -7, interpreted[name]


@requires_interpreter
@pytest.mark.parametrize("name", list(TAIL_CASES))
def test_grouped_kernel_zeroes_rows_past_the_last_expert(interpreted, name):
    """Rows past offsets[-1] come out zero from an output filled with NaN: no zero fill needed before."""
    r = interpreted["tail_" + name]
    assert r["same"] and r["err"] <= 2 ** -7, r


# (BLOCK_M, BLOCK_N, BLOCK_K, PARTIAL, PTX, EVEN_K): the defaults and the largest tiles of scripts/sweep_native.py
# (whose shapes all have EVEN_K)
@pytest.mark.parametrize("block_m, block_n, block_k, partial, ptx, even_k", [
    (16, 64, 128, True, True, True), (16, 64, 128, False, False, False), (64, 64, 128, False, True, True),
    (64, 128, 128, True, True, True), (64, 64, 256, True, True, True), (16, 32, 128, True, True, True)])
def test_fp8_kernel_compiles_for_hopper_without_spills(block_m, block_n, block_k, partial, ptx, even_k):
    from dsflash_compile.custom_ops import fp8_linear_triton

    args = dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", out_ptr="*fp32" if partial else "*bf16", M="i32", N="i32",
                K="i32", x_stride="i32", n_per_group="i32", k_blocks_per_split="i32")
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=partial, FP32_DOT=False, PTX=ptx,
                      EVEN_K=even_k)
    # specialized as a release launch is: torch's pointers and the release's sizes are multiples of 16
    check_compiles_for_hopper(fp8_linear_triton, ("_fp8_linear_kernel", args, constexprs, 4),
                              ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "K", "x_stride", "n_per_group"))
    args = dict(partial_ptr="*fp32", out_ptr="*bf16", numel="i32", splits="i32")
    check_compiles_for_hopper(fp8_linear_triton, ("_sum_splits_kernel", args, dict(BLOCK=1024), 4))


# (MXFP4, PTX, BLOCK_M, BLOCK_N, BLOCK_K, warps): the launches' defaults (MXFP4 at each BLOCK_M block_m_for picks)
# and the largest tiles of scripts/sweep_experts.py and scripts/sweep_native.py (whose grid runs at block_m_for's)
@pytest.mark.parametrize("mxfp4, ptx, block_m, block_n, block_k, warps", [
    (True, True, 16, 64, 128, 4), (True, False, 16, 64, 128, 4), (True, True, 16, 32, 256, 4),
    (True, True, 16, 64, 256, 8), (True, True, 32, 64, 128, 4), (True, True, 64, 64, 128, 4),
    (True, False, 64, 64, 128, 4), (True, True, 64, 64, 256, 8),
    (False, False, 16, 32, 128, 4), (False, False, 16, 64, 256, 8), (False, False, 16, 16, 256, 4),
    (False, False, 32, 128, 128, 4), (False, False, 64, 64, 64, 4), (False, False, 64, 128, 128, 8)])
def test_grouped_kernel_compiles_for_hopper_without_spills(mxfp4, ptx, block_m, block_n, block_k, warps):
    from dsflash_compile.custom_ops import mxfp4_experts_triton

    weight = "*u8" if mxfp4 else "*bf16"
    args = dict(x_ptr="*bf16", w_ptr=weight, s_ptr="*u8" if mxfp4 else weight, offsets_ptr="*i32",
                out_ptr="*bf16", P="i32", E="i32", N="i32", K="i32")
    # E_PAD 512: the release's 384 experts
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, E_PAD=512, MXFP4=mxfp4, FP32_DOT=False,
                      PTX=ptx)
    check_compiles_for_hopper(mxfp4_experts_triton, ("_grouped_kernel", args, constexprs, warps),
                              ("x_ptr", "w_ptr", "s_ptr", "offsets_ptr", "out_ptr", "N", "K"))


# ----------------------------------------------------------------------------------- the model


def held_bytes(model) -> int:
    """Bytes of every parameter and buffer, each storage once (stacked experts and their views share)."""
    storages = {}
    for t in (*model.parameters(), *model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.fixture(scope="module")
def bf16_model():
    return load_model()


@pytest.fixture(scope="module")
def native_model():
    return load_model(weights="native")


def prefill_and_decode(model, steps=2):
    ids, dec = (fixture()["inputs"][k].to(model.device) for k in ("prompt_ids", "decode_input_ids"))
    cache = model.new_cache(1, ids.shape[1] + steps)
    with torch.no_grad():
        logits = [model(ids, cache=cache).logits]
        logits += [model(dec[:, i:i + 1], cache=cache).logits for i in range(steps)]
    return torch.cat(logits, 1)


@requires_golden
def test_cpu_default_is_bf16(bf16_model):
    assert bf16_model.config.text_config.weights == "bf16"
    assert type(bf16_model.model.layers[0].attn.wq_a) is QuantLinear


@requires_golden
def test_native_logits_equal_bf16_logits(bf16_model, native_model):
    """Prefill (100 tokens) and 2 decode steps on the golden fixture: the same logits bit for bit."""
    assert torch.equal(prefill_and_decode(native_model), prefill_and_decode(bf16_model))


@requires_golden
def test_native_model_holds_the_checkpoint_bytes(bf16_model, native_model):
    """Every FP8 / MXFP4 projection holds exactly the file's weight and scale tensors (no bf16 copy), and
    the model's memory shrinks by the difference between bf16 and the stored bytes."""
    stored = load_file(TINY_A / "model.safetensors")
    state = {k.removeprefix("model."): v for k, v in native_model.state_dict().items()}
    quantized = [n for n in stored if weight_format(n) in (FP8_BLOCK, MXFP4)]
    assert quantized and all(torch.equal(state[n].view(torch.uint8), stored[n].view(torch.uint8)) for n in quantized)
    assert all(m.weight.dtype in (torch.float8_e4m3fn, torch.int8)
               for m in native_model.modules() if isinstance(m, QuantLinear))
    encoded = sum(stored[n].nbytes for n in quantized)
    as_bf16 = sum(2 * state[n].numel() * (2 if weight_format(n) == MXFP4 else 1)
                  for n in quantized if n.endswith(".weight"))
    native, bf16 = held_bytes(native_model), held_bytes(bf16_model)
    print(f"weights held: native {native} B, bf16 {bf16} B (projections {encoded} B encoded, {as_bf16} B as bf16)")
    assert bf16 - native == as_bf16 - encoded


@requires_golden
def test_native_save_writes_the_same_bytes_and_reloads(native_model, bf16_model, tmp_path):
    native_model.save_pretrained(tmp_path)
    saved, stored = load_file(tmp_path / "model.safetensors"), load_file(TINY_A / "model.safetensors")
    assert saved.keys() == stored.keys()
    assert all(torch.equal(saved[n].view(torch.uint8), stored[n].view(torch.uint8))
               for n in stored if weight_format(n) in (FP8_BLOCK, MXFP4))
    ids = fixture()["inputs"]["prompt_ids"]
    reloaded = DeepseekV41ForCausalLM.from_pretrained(tmp_path, swa_bounded_replay=False, weights="bf16")
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, bf16_model(ids).logits)


def test_experts_stay_views_of_their_stack_after_a_move():
    """Moving a stacked model (here: a copy of every tensor) leaves one copy of the experts, not two."""
    model = DeepseekV41ForCausalLM(preset_config("tiny", weights="native"))
    moe = model.model.layers[0].ffn
    model._apply(torch.clone)
    base = moe.w1_weight_stacked.untyped_storage().data_ptr()
    assert all(e.w1.weight.untyped_storage().data_ptr() == base for e in moe.experts)
    assert all(e.w2.scale.untyped_storage().data_ptr() == moe.w2_scale_stacked.untyped_storage().data_ptr()
               for e in moe.experts)


def test_a_loaded_expert_tensor_makes_the_stacks_stale():
    """An expert tensor replaced as load_state_dict(assign=True) does leaves the stacks stale (from_pretrained
    and compile() restack then), and only then."""
    moe = MoE(preset_config("tiny", weights="native").text_config)
    assert moe.grouped and not moe.stacks_stale()
    hold(moe.experts[3].w2, "scale", moe.experts[3].w2.scale.clone())
    assert moe.stacks_stale()
    moe.stack_experts()
    assert not moe.stacks_stale()


def test_ensure_grouped_restacks_only_a_stale_or_other_layout():
    """ensure_grouped (compile(), eager scripts): current stacks of the asked layout are kept; another layout
    (shared expert stacked or not) or a stale stack is stacked anew."""
    moe = tiny_moe()
    moe.ensure_grouped(shared=True)
    stack = moe.w1_weight_stacked
    assert moe.grouped and moe.shared_stacked and stack.shape[0] == len(moe.experts) + 1
    moe.ensure_grouped(shared=True)
    assert moe.w1_weight_stacked is stack
    moe.ensure_grouped(shared=False)
    assert not moe.shared_stacked and moe.w1_weight_stacked.shape[0] == len(moe.experts)
    stack = moe.w1_weight_stacked
    hold(moe.experts[3].w2, "weight", moe.experts[3].w2.weight.detach().clone())
    moe.ensure_grouped(shared=False)
    assert moe.w1_weight_stacked is not stack and not moe.stacks_stale()


@torch.no_grad()
def test_random_native_model_equals_random_bf16_model():
    """A preset built with native weights draws the same values as the bf16 one (kept encoded)."""
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = []
    for weights in ("native", "bf16"):
        torch.manual_seed(0)
        logits.append(DeepseekV41ForCausalLM(preset_config("tiny", weights=weights)).eval()(ids).logits)
    assert torch.equal(*logits)


@torch.no_grad()
def test_native_model_compiles_without_graph_breaks():
    """dsflash_compile.compile on a native model (the "eager" backend: Dynamo's capture with fullgraph, which
    fails on any graph break; the ops' fake kernels under AOT dispatch are opcheck's part above): a prefill
    chunk through the compiled blocks equals the eager model's, with no graph break."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(preset_config("tiny", weights="native")).eval()
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    want = model(ids).logits
    dsflash_compile.compile(model, max_batch=2, max_length=64, batch_buckets=(2,), prefill_buckets=(16,),
                            backend="eager", passes=False)
    try:
        got = model(ids, cache=model.compiled_runner.fresh_cache(2, 64)).logits
        assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
        assert torch.equal(got, want)
    finally:
        torch._dynamo.reset()


def test_unknown_weights_option_is_named():
    with pytest.raises(ScheduleError, match="weights: 'fp4'"):
        preset_config("tiny", weights="fp4")


@requires_golden
def test_native_load_of_a_dequantized_projection_is_named(tmp_path):
    """convert.py writes wo_a dequantized (bf16, no scale): native loading says so and what to do."""
    for f in TINY_A.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(TINY_A / "model.safetensors")
    name = "layers.0.attn.wo_a"
    tensors[name + ".weight"] = formats.dequant_fp8_block(tensors.pop(name + ".weight"), tensors.pop(name + ".scale"))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"wo_a.weight: stored dequantized \(BF16.*load with weights='bf16'"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path, weights="native")
    assert DeepseekV41ForCausalLM.from_pretrained(tmp_path, weights="bf16") is not None


@requires_golden
def test_native_load_takes_experts_stored_as_u8(tmp_path, native_model):
    """MXFP4 experts stored as U8 (the reader accepts I8 or U8) load into the native I8 buffers unchanged."""
    for f in TINY_A.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(TINY_A / "model.safetensors")
    name = "layers.0.ffn.experts.3.w2.weight"
    tensors[name] = tensors[name].view(torch.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = DeepseekV41ForCausalLM.from_pretrained(tmp_path, weights="native")
    expert = loaded.model.layers[0].ffn.experts[3].w2.weight
    assert expert.dtype == torch.int8 and torch.equal(expert, native_model.model.layers[0].ffn.experts[3].w2.weight)


# ----------------------------------------------------------------------------------- CUDA


@requires_cuda
@pytest.mark.parametrize("rows", [1, 8, 64, 256, 300])
@pytest.mark.parametrize("shape", [(1280, 5120, 1), (32768, 1280, 1), (8192, 4096, 8), (5120, 8192, 1)])
def test_fp8_block_linear_cuda_release_shapes(rows, shape):
    """The registered CUDA op at the release's projection shapes (wq_a, wq_b, wo_a, wo_b) against the
    reference on the GPU (Triton up to MAX_ROWS rows, the reference's cuBLAS product above), and opcheck."""
    n, k, groups = shape
    x, weight, scale = fp8_case(rows, n, k, groups, device="cuda")
    got = ops.fp8_block_linear(x, weight, scale, groups)
    from dsflash_compile.custom_ops.fp8_linear import fp8_block_linear_reference

    want = fp8_block_linear_reference(x, weight, scale, groups)
    mag = fp8_block_linear_reference(x.abs(), weight.float().abs().to(torch.float8_e4m3fn), scale, groups)
    assert relative_error(got, want, mag.float()) <= 2 ** -7
    if rows == 8:
        opcheck(ops.fp8_block_linear.default, (x, weight, scale, groups))


@requires_cuda
@pytest.mark.parametrize("ptx", [False, True])
def test_kernels_dequantize_every_code_exactly_on_cuda(ptx):
    """x = identity rows, so each output is one product: the kernels' dequantized weights equal the references'
    bit for bit, for every E4M3 code but NaN and every E2M1 byte, under scales from 2^-126 to 2^7: the smallest
    make products subnormal in bf16, rounded once from the exact product (a scale byte of 0, 2^-127, reads as
    0: the kernels' docstrings say so). Not on the interpreter: its fp32 -> bf16 casts flush subnormals."""
    from dsflash_compile.custom_ops.fp8_linear_triton import fp8_block_linear_triton
    from dsflash_compile.custom_ops.mxfp4_experts_triton import grouped_mm_triton

    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    codes[(codes & 0x7F) == 0x7F] = 0  # NaN
    weight = codes.repeat(64, 1).view(torch.float8_e4m3fn)  # [64, 256]: each row every code
    exps = torch.tensor([1, 3, 8, 20, 100, 120, 127, 134], device="cuda", dtype=torch.uint8)
    scale = torch.stack([exps, exps.roll(4)]).view(torch.float8_e8m0fnu)  # [2, 8] 32 x 32 tiles: each code, 2 scales
    x = torch.eye(256, device="cuda").bfloat16()
    got = fp8_block_linear_triton(x, weight, scale, block_m=64, ptx=ptx)
    assert torch.equal(got.t(), formats.dequant_fp8_block(weight, scale))
    packed = torch.arange(256, device="cuda").to(torch.uint8).view(torch.int8).repeat(64, 1)[None]  # [1, 64, 256]
    mx_exps = torch.tensor([1, 2, 3, 20, 100, 110, 127, 128], device="cuda", dtype=torch.uint8).repeat(2)
    mx_scale = torch.stack([mx_exps.roll(r) for r in range(64)])[None].view(torch.float8_e8m0fnu)  # every byte, 8
    x = torch.eye(512, device="cuda").bfloat16()
    got = grouped_mm_triton(x, packed, mx_scale, torch.tensor([512], dtype=torch.int32, device="cuda"), ptx=ptx)
    assert torch.equal(got.t(), formats.dequant_mxfp4(packed[0], mx_scale[0]))


@requires_cuda
@pytest.mark.parametrize("experts,tokens", [(384, 1), (384, 8), (384, 64), (8, 8), (8, 64)])
def test_mxfp4_grouped_mm_cuda_release_shapes(experts, tokens):
    """384 experts (8: flash-40l-e8, whose 48 rows per expert at 64 tokens take BLOCK_M 64), top-6, D = 5120,
    intermediate 2304 (w1) against the reference; CUDA-graph capture."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:6] for _ in range(tokens)]).flatten()
    counts = torch.bincount(ids, minlength=experts).tolist()
    x, weight, scale, offsets = mxfp4_case(counts, 2304, 5120, device="cuda")
    from dsflash_compile.custom_ops.mxfp4_experts import mxfp4_grouped_mm_reference

    got = ops.mxfp4_grouped_mm(x, weight, scale, offsets)
    want = mxfp4_grouped_mm_reference(x, weight, scale, offsets)
    mag = mxfp4_grouped_mm_reference(x.abs(), weight & 0x77, scale, offsets)
    assert relative_error(got, want, mag.float()) <= 2 ** -7
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.mxfp4_grouped_mm(x, weight, scale, offsets)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, got)
    opcheck(ops.mxfp4_grouped_mm.default, (x, weight, scale, offsets))


@requires_cuda
@requires_golden
def test_native_cuda_model_matches_bf16_within_golden_bounds():
    """On the GPU (the default there is native) the Triton ops' summation order differs from cuBLAS's: logits
    stay within the golden fixture's end-to-end bound and agree on the argmax."""
    from golden import probe

    native = load_model(device_map="cuda")
    assert native.config.text_config.weights == "native"
    bf16 = load_model(device_map="cuda", weights="bf16")
    got, want = prefill_and_decode(native).cpu(), prefill_and_decode(bf16).cpu()
    assert (got - want).abs().max() <= probe("prefill_logits", "max_abs")
    assert torch.equal(got.argmax(-1), want.argmax(-1))
