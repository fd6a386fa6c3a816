"""`dsflash::expert_order` (custom_ops/expert_order.py): its reference against MoE's counting orders, its
Triton kernel under the interpreter and on CUDA, its checks."""

import pytest
import torch

from dsflash_compile import preset_config
from dsflash_compile.custom_ops.expert_order import MAX_ONEHOT, expert_order_reference, kernel_fits
from dsflash_compile.moe import MoE
from hopper import check_compiles_for_hopper
from interp import report, requires_interpreter, run_interpreted

CASES = {  # name: (tokens, k, groups, share of pairs elsewhere (-1))
    "decode": (1, 7, 9, 0.0),
    "batch": (5, 6, 8, 0.3),
    "b64": (64, 7, 9, 0.0),
    "b64_elsewhere": (64, 7, 9, 0.2),
    "one_slot": (3, 1, 1, 0.0),
    "wide": (100, 7, 9, 0.1),  # 700 pairs: 1024 lanes
}


def routed_ids(tokens, k, groups, elsewhere, seed=0):
    """Each token's k distinct experts (k <= groups), some marked -1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(groups, generator=gen)[:k] for _ in range(tokens)])
    return ids.masked_fill(torch.rand(ids.shape, generator=gen) < elsewhere, -1)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_is_moes_counting_orders(name):
    """The op's definition (argsort) gives MoE's counting orders, and offsets as MoE counts them."""
    tokens, k, groups, elsewhere = CASES[name]
    ids = routed_ids(tokens, k, groups, elsewhere)
    moe = MoE(preset_config("tiny").text_config)
    moe.count_order = 1 << 30
    expert = ids.flatten()
    order, rank = moe._expert_order(torch.where(expert >= 0, expert, groups), groups)
    counts = torch.zeros(groups, dtype=torch.int32).scatter_add_(0, expert.clamp(min=0), (expert >= 0).int())
    want = (order, rank, counts.cumsum(0, dtype=torch.int32), moe._slot_order(ids))
    got = expert_order_reference(ids, groups)
    assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_opcheck():
    torch.library.opcheck(torch.ops.dsflash.expert_order.default, (routed_ids(5, 6, 8, 0.3), 8))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="int64"):
        torch.ops.dsflash.expert_order(routed_ids(2, 3, 4, 0.0).int(), 4)
    with pytest.raises(ValueError, match="groups"):
        torch.ops.dsflash.expert_order(routed_ids(2, 3, 4, 0.0), 0)


def test_kernel_fits_bounds_the_one_hot():
    assert kernel_fits(448, 9) and kernel_fits(1024, 15) and not kernel_fits(1025, 15)
    assert not kernel_fits(448, 384) and not kernel_fits(0, 9)
    assert kernel_fits(MAX_ONEHOT // 2, 1)


def interpreter_checks():
    from dsflash_compile.custom_ops.expert_order_triton import expert_order_triton

    for name, (tokens, k, groups, elsewhere) in CASES.items():
        ids = routed_ids(tokens, k, groups, elsewhere, seed=1)
        got = expert_order_triton(ids, groups)
        want = expert_order_reference(ids, groups)
        report(dict(name=name, equal=[g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want)]))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_expert_order", "interpreter_checks")


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    assert interpreted[name]["equal"] == [True] * 4


@pytest.mark.parametrize("block_p, g_pad, t_pad, k_pad", [(512, 16, 64, 8), (1024, 16, 128, 8), (8, 16, 1, 8)])
def test_kernel_compiles_for_hopper(block_p, g_pad, t_pad, k_pad):
    from dsflash_compile.custom_ops import expert_order_triton

    args = dict(ids_ptr="*i64", order_ptr="*i64", rank_ptr="*i64", offsets_ptr="*i32", ascending_ptr="*i64",
                T="i32", KK="i32", G="i32")
    constexprs = dict(BLOCK_P=block_p, G_PAD=g_pad, T_PAD=t_pad, K_PAD=k_pad)
    check_compiles_for_hopper(expert_order_triton, ("_expert_order_kernel", args, constexprs,
                                                    4 if block_p <= 512 else 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_on_cuda(name):
    tokens, k, groups, elsewhere = CASES[name]
    ids = routed_ids(tokens, k, groups, elsewhere, seed=2)
    got = torch.ops.dsflash.expert_order(ids.cuda(), groups)
    want = expert_order_reference(ids, groups)
    assert all(g.dtype == w.dtype and torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))


@torch.no_grad()
@pytest.mark.parametrize("shared", [False, True])
def test_moe_takes_the_op_where_it_fits(shared, monkeypatch):
    """With order_op (compile() sets it) the grouped MoE path takes its orders from the op and gives the expert
    loop's bits; MoE's own counting orders do not run."""
    from test_native_weights import tiny_moe

    moe = tiny_moe()
    x = torch.randn(4, 1, moe.gate.weight.shape[1]).bfloat16()
    want = moe(x)
    moe.stack_experts(shared=shared and moe.can_stack_shared())
    moe.few_rows, moe.count_order, moe.order_op = 64, 1 << 22, True

    def forbidden(*args):
        raise AssertionError("MoE's counting orders ran where dsflash::expert_order fits")
    monkeypatch.setattr(MoE, "_expert_order", forbidden)
    monkeypatch.setattr(MoE, "_slot_order", forbidden)
    assert torch.equal(moe(x), want)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), want)
