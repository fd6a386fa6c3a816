"""Past one GPU (SYSTEM.md, parallelism): tensor, expert and data-parallel attention over one process group.

`parallelize(model, config, group)` shards a built model in place; every rank builds (or loads) the same
model first. All parallel dimensions span the same group (a 2-D mesh is later work):
  - TP: attention heads split (wq_b's rows, the sinks, wo_a's groups; the MQA KV, compressor and indexer
    replicated), wo_b row-parallel with an all-reduce after it; every expert's intermediate dim split
    (w1 / w3 column-, w2 row-parallel): the routed and the shared expert's partial sums share the MoE's one
    all-reduce.
  - EP: each rank keeps n_routed_experts / ep consecutive routed experts; router and shared expert are
    replicated (the shared expert is TP-split when tp > 1). Every rank runs its experts on the tokens it
    sees and the MoE's one collective sums the ranks' partial outputs.
  - DP attention (with EP): each rank runs its own requests (own cache); the MoE all-gathers the tokens
    with their routing, runs its experts, and reduce-scatters the sums back to the tokens' owners.
Collectives are the functional ones (torch.distributed._functional_collectives), which torch.compile traces.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from .configuration_deepseek_v41 import DeepseekV41TextConfig
from .layers import NativeQuantLinear, QuantLinear, fp32_linear
from .moe import MoE

QUANT_BLOCK = 32  # FP8 weight tiles and activation groups: a shard boundary must not cut one


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    ep: int = 1
    dp_attention: bool = False

    def validate(self, text: DeepseekV41TextConfig, world: int) -> None:
        for name in ("tp", "ep"):
            size = getattr(self, name)
            if size not in (1, world):
                raise ValueError(f"ParallelConfig.{name}={size} must be 1 or the group size {world} (every "
                                 "parallel dimension spans the one group)")
        if self.dp_attention and (self.tp != 1 or self.ep != world or world == 1):
            raise ValueError(f"ParallelConfig.dp_attention needs tp=1 and ep={world} (the group size); got "
                             f"tp={self.tp}, ep={self.ep}")
        if text.n_routed_experts % self.ep:
            raise ValueError(f"ParallelConfig.ep={self.ep} does not divide n_routed_experts={text.n_routed_experts}")
        if text.num_attention_heads % self.tp or text.o_groups % self.tp:
            raise ValueError(f"ParallelConfig.tp={self.tp} must divide num_attention_heads="
                             f"{text.num_attention_heads} and o_groups={text.o_groups} (a rank owns whole groups)")
        if text.moe_intermediate_size % (self.tp * QUANT_BLOCK):
            raise ValueError(f"ParallelConfig.tp={self.tp}: moe_intermediate_size={text.moe_intermediate_size} / tp "
                             f"must be a multiple of {QUANT_BLOCK} (FP8 tiles and activation groups)")


# The deployments by name (the scripts, memory_plan and the tests name them here). 1gpu: the unsharded model;
# tp: heads, the shared and every routed expert's intermediate dim split, requests replicated; ep: whole routed
# experts per rank, the rest replicated; tp+ep: both; dp+ep: EP, each rank its own requests (DP attention)
LAYOUT_NAMES = ("1gpu", "tp", "ep", "tp+ep", "dp+ep")


def layout_fits(name: str, world: int) -> bool:
    """Whether layout `name` can span `world` ranks at all: '1gpu' exactly 1, a 1-rank tp / ep would just be
    the unsharded model."""
    return world >= 1 and (world == 1) == (name == "1gpu")


def layout(name: str, world: int) -> ParallelConfig:
    """The ParallelConfig of layout `name` over a group of `world` ranks: every sharded dimension spans the
    whole group (whether the model divides by it is ParallelConfig.validate's check)."""
    if name not in LAYOUT_NAMES:
        raise ValueError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUT_NAMES)}")
    if not layout_fits(name, world):
        wants = "exactly 1 rank" if name == "1gpu" else "2 or more ranks ('1gpu' on one)"
        raise ValueError(f"layout {name!r} needs {wants}, not world={world}")
    return ParallelConfig(tp=world if "tp" in name else 1, ep=world if "ep" in name else 1,
                          dp_attention=name == "dp+ep")


def init_distributed(backend: str | None = None) -> dist.ProcessGroup:
    """The default process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*),
    initialised once: NCCL with each rank on its local GPU, gloo on CPU."""
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
    return dist.group.WORLD


# -- collectives: one line each, so the model code names what it does ------------------------------------
# torch 2.11 has only the *_tensor names, which newer releases deprecate for *_single
_all_gather_single = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
_reduce_scatter_single = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's x along dim 0 (rank order); all ranks' shapes must match."""
    return funcol.wait_tensor(_all_gather_single(x, 0, group))


def all_gather_rows(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """all_gather of tensors of one row count ([T, ...] each, any dtypes) in one collective: each row's bytes
    side by side, widest dtype first (so every piece starts aligned for its dtype; the row is padded to 8
    bytes), viewed back as the tensors after. One launch and one wait instead of one per tensor."""
    rows = tensors[0].shape[0]
    if any(t.dim() == 0 or t.shape[0] != rows for t in tensors):
        raise ValueError(f"all_gather_rows: every tensor needs {rows} rows, got shapes {[tuple(t.shape) for t in tensors]}")
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    pieces = [_row_bytes(tensors[i]) for i in order]
    pad = -sum(piece.shape[1] for piece in pieces) % 8
    gathered = all_gather(torch.cat(pieces + ([pieces[0].new_zeros(rows, pad)] if pad else []), 1), group)
    out, start = [None] * len(tensors), 0
    for i, piece in zip(order, pieces):
        t = tensors[i]
        out[i] = gathered[:, start:start + piece.shape[1]].view(t.dtype).reshape(-1, *t.shape[1:])
        start += piece.shape[1]
    return out


def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    """t [T, ...] as [T, bytes per row] uint8; a copy only where the last dim is strided (the uint8 view needs
    stride 1 there; .contiguous() keeps a size-1 dim's odd stride)."""
    flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return (flat if flat.stride(-1) == 1 else flat.clone(memory_format=torch.contiguous_format)).view(torch.uint8)


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over ranks, then keep this rank's slice of dim 0 (the inverse of all_gather's layout)."""
    return funcol.wait_tensor(_reduce_scatter_single(x, "sum", 0, group))


def owned_by(text: DeepseekV41TextConfig, config: ParallelConfig, group: dist.ProcessGroup):
    """Which checkpoint tensors (official names) this rank reads: all but other ranks' routed experts. TP
    tensors are read whole and sliced by parallelize (they are small next to the experts)."""
    rank, local = dist.get_rank(group), text.n_routed_experts // config.ep

    def owned(name: str) -> bool:
        expert = _ROUTED_EXPERT.match(name)
        return expert is None or config.ep == 1 or int(expert[1]) // local == rank
    return owned


_ROUTED_EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.(\d+)\.")


# -- sharding -----------------------------------------------------------------------------------------
def parallelize(model: nn.Module, config: ParallelConfig, group: dist.ProcessGroup) -> nn.Module:
    """Shard `model` (a DeepseekV41ForCausalLM) in place for this rank of `group`; returns it."""
    text = model.model.text_config
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    config.validate(text, world)
    for block in model.model.layers:
        if config.tp > 1:
            shard_attention(block.attn, rank, config.tp, group)
        if config.tp > 1 or config.ep > 1:
            shard_moe(block.ffn, config, rank, group)
    return model


def shard_attention(attn: nn.Module, rank: int, tp: int, group: dist.ProcessGroup) -> None:
    """This rank's heads: query rows and sinks, their output groups (wo_a is block-diagonal over groups, so
    a rank owning whole groups needs no communication before wo_b); wo_b sums over ranks."""
    attn.heads //= tp
    attn.groups //= tp
    _shard(attn.wq_b, 0, rank, tp)
    _shard(attn.wo_a, 0, rank, tp)
    attn.wo_a.groups //= tp
    attn.attn_sink = nn.Parameter(attn.attn_sink.detach().chunk(tp)[rank].clone(), requires_grad=False)
    _shard(attn.wo_b, 1, rank, tp)
    row_parallel(attn.wo_b, group)


def shard_expert(expert: nn.Module, rank: int, tp: int) -> None:
    """SwiGLU column-then-row: this rank's slice of the intermediate dim; the output is a partial sum."""
    _shard(expert.w1, 0, rank, tp)
    _shard(expert.w3, 0, rank, tp)
    _shard(expert.w2, 1, rank, tp)


def shard_moe(moe: MoE, config: ParallelConfig, rank: int, group: dist.ProcessGroup) -> None:
    """EP: this rank's consecutive slice of the routed experts (renumbered from 0 here: `first_expert` maps the
    router's ids); else TP: every expert's intermediate dim split. The shared expert is TP-split with tp."""
    if config.ep > 1:
        local = len(moe.experts) // config.ep
        moe.first_expert = rank * local
        moe.experts = nn.ModuleList(list(moe.experts)[moe.first_expert:moe.first_expert + local])
    else:
        moe.first_expert = 0
        for expert in moe.experts:
            shard_expert(expert, rank, config.tp)
    if config.tp > 1:  # its partial sum joins the routed experts' all-reduce (ParallelMoE.routed_and_shared)
        shard_expert(moe.shared_experts, rank, config.tp)
        if not isinstance(moe.shared_experts.w2, NativeQuantLinear):
            moe.shared_experts.w2.__class__ = PartialSumLinear
    moe.shared_partial = config.tp > 1
    if moe.grouped:
        moe.stack_experts()  # restack this rank's tensors only (the old stacks are freed)
    moe.group, moe.dp_attention = group, config.dp_attention
    moe.__class__ = ParallelMoE


def row_parallel(linear: QuantLinear, group: dist.ProcessGroup) -> None:
    """Make a linear whose inputs are split across ranks return the sum over ranks. bf16 weights: partial
    products in fp32, summed in fp32 and rounded to bf16 once, where the unsharded product rounds (so TP
    attention equals the unsharded model; bf16 partials would round twice). Native weights: the dsflash
    ops return bf16, so their partials are summed in bf16 (rounded twice; an fp32-output op is to do)."""
    if isinstance(linear, NativeQuantLinear):
        linear.register_forward_hook(lambda _module, _inputs, out: all_reduce(out, group))
    else:
        linear.group = group
        linear.__class__ = RowParallelLinear


class PartialSumLinear(QuantLinear):
    """A bf16-weight QuantLinear holding a slice of the inputs that returns its fp32 partial product, for the
    caller to sum over ranks (ParallelMoE.routed_and_shared's one all-reduce)."""

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return fp32_linear(x.to(self.weight.dtype), self.weight)


class RowParallelLinear(PartialSumLinear):
    """A bf16-weight QuantLinear holding a slice of the inputs (see row_parallel)."""

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().product(x), self.group).to(self.weight.dtype)


def _shard(linear: nn.Module, dim: int, rank: int, parts: int) -> None:
    """Keep this rank's `parts`-th of a QuantLinear / NativeQuantLinear along dim 0 (outputs) or 1 (inputs).
    Native tensors are sliced in their stored units: MXFP4 packs two inputs a byte, scales cover 32."""
    for name in ("weight", "scale"):
        t = getattr(linear, name, None)
        if t is None:
            continue
        piece = t.detach().chunk(parts, dim)[rank].clone()  # own storage: the full tensor can be freed
        if name in linear._parameters:
            setattr(linear, name, nn.Parameter(piece, requires_grad=False))
        else:
            setattr(linear, name, piece)
    if dim == 0:
        linear.out_features //= parts
    else:
        linear.in_features //= parts


class ParallelMoE(MoE):
    """MoE whose routed experts are this rank's share (see shard_moe): MoE's forward, with the dispatch /
    combine around the routed experts; under TP the shared expert's partial joins the same all-reduce
    (routed_and_shared).

    The simplest dispatch, for small batches: every rank sees every token (replicated under TP / EP,
    all-gathered with its routing under DP attention) and the combine sums the ranks' outputs (all-reduce,
    or reduce-scatter back to the tokens' owners). The grouped path keeps static shapes (no host sync, one
    graph) by sorting other ranks' pairs after its own, past the last offset: no GEMM computes them (the
    loop skips them too). An all-to-all of only the routed pairs is the alternative, to be chosen by
    measurement on 2 GPUs."""

    def can_stack_shared(self) -> bool:
        return False  # the routed part is reduced over ranks, the shared expert is not (or is TP-split)

    def routed_and_shared(self, x, weights, ids) -> torch.Tensor:
        if not self.shared_partial:  # the shared expert replicated: routed() reduces
            return super().routed_and_shared(x, weights, ids)
        # TP: the shared expert's partial sum rides in the routed experts' all-reduce, one collective per MoE
        # instead of two. Stacked, each is still summed on its own, then rounded where the two separate
        # all-reduces rounded: the same bits with 2 ranks (a + b = b + a); with more, the ring's order of
        # addition per element may differ. Native weights' bf16 shared partial is summed in fp32 too.
        partials = torch.stack([self._routed_here(x, weights, ids), self.shared_experts(x).float()])
        routed, shared = all_reduce(partials, self.group)
        return routed + shared.to(x.dtype)

    def routed(self, x, weights, ids) -> torch.Tensor:
        """This rank's tokens' routed output, summed over every rank's experts (used when the shared expert,
        added by MoE.routed_and_shared, is replicated; TP-split, it shares the all-reduce there)."""
        if self.dp_attention:  # every rank's tokens meet every rank's experts
            x, weights, ids = all_gather_rows([x, weights, ids], self.group)
        y = self._routed_here(x, weights, ids)
        return reduce_scatter(y, self.group) if self.dp_attention else all_reduce(y, self.group)

    def _routed_here(self, x, weights, ids) -> torch.Tensor:
        """The routed experts' output from this rank's experts only (fp32; zero where none is here)."""
        local = ids - self.first_expert
        mine = (local >= 0) & (local < len(self.experts))
        if self.grouped:  # static shapes: other ranks' pairs sort past the last offset, computed by no GEMM
            return self._routed_grouped(x, weights, torch.where(mine, local, -1))
        return self._routed_loop(x, weights, torch.where(mine, local, -1))
