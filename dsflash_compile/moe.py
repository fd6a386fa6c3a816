"""Mixture of experts (MODEL.md section 5): sqrt-softplus router with a selection-only bias, top-k
routed SwiGLU experts scaled by their normalised weights, plus one shared expert.

The router (`route`) stays a plain function so the compiler's gating pass can match and fuse it.

Two ways to run the routed experts, with the same math and the same summation order per token:
  - the reference loop (one expert at a time over its tokens): needs the host to know which experts are
    used (a sync), so it cannot live in a captured CUDA graph;
  - grouped (after `stack_experts()`): (token, slot) pairs sorted by expert, one grouped GEMM per
    projection over the stacked weights; no host syncs and static shapes, so it compiles to one graph.
    With native weights (config `weights="native"`) the stacks are the MXFP4 bytes and scales and the
    grouped GEMM is `dsflash::mxfp4_grouped_mm`; such a model is stacked from the start (and again after
    from_pretrained assigns the loaded tensors), so it runs grouped unless told otherwise. With bf16 weights,
    up to `few_rows` (token, slot) pairs (compile() sets it: the decode step) run `dsflash::grouped_mm`,
    else torch._grouped_mm (`dsflash::grouped_mm_by_rows` picks when it runs); with
    `count_order` set, the sorts are counts (see _expert_order, _slot_order); with `swiglu_op`, up to
    `few_rows` pairs the gather of x, the w1 and w3 GEMMs and the SwiGLU are `dsflash::grouped_swiglu` (one
    launch on CUDA). Up to `few_tokens` tokens (compile() sets it: decode) skip the sort:
    `dsflash::routed_experts` runs the three projections per picked expert and sums each token's terms in
    ascending id, in two launches on CUDA (the FP8 of x, the shared expert's pair and the sum inside them).
    With bf16 weights the shared expert can be stacked too (`stack_experts(shared=True)`):
    it is then every token's last pair, with weight 1 (exact), and added last as before, so the same bits
    with three projections fewer per layer.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_deepseek_v41 import DeepseekV41TextConfig
from .custom_ops import expert_order
from .custom_ops.routed_experts import with_shared_expert
from .custom_ops.token_sum import token_sum_reference
from .layers import hold, quant_linear, same_storage
from .quant import fp8_qdq


# MoE.count_order for decode and short prefills: pairs x (groups + 1) up to 2^22 (any decode batch up to 64
# and ~1.5K-token chunks of the release, 385 groups), a [groups + 1, pairs] one-hot of at most 16 MB
COUNT_ORDER_BOUND = 1 << 22


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, topk: int, normalize: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (weights fp32 [N, k], expert ids [N, k]). The bias picks experts but never scales them."""
    scores = F.softplus(F.linear(x.float(), weight.float())).sqrt()
    ids = (scores + bias).topk(topk, dim=-1)[1]
    weights = scores.gather(1, ids)
    if normalize and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class Gate(nn.Module):
    def __init__(self, config: DeepseekV41TextConfig):
        super().__init__()
        self.topk, self.normalize, self.scale = (config.num_experts_per_tok, config.norm_topk_prob,
                                                 config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))
        # Image-span routing bias of the release; text tokens never use it (kept so checkpoints round-trip).
        self.bias_vl = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.weight, self.bias, self.topk, self.normalize, self.scale)


class Expert(nn.Module):
    """SwiGLU in fp32 with the release's clamps: gate only from above, up on both sides."""

    def __init__(self, config: DeepseekV41TextConfig, storage: str):
        super().__init__()
        dim, inter, q = config.hidden_size, config.moe_intermediate_size, config.quantize_dequantize
        self.limit = config.swiglu_limit
        self.w1 = quant_linear(config, dim, inter, q, storage)
        self.w2 = quant_linear(config, inter, dim, q, storage)
        self.w3 = quant_linear(config, dim, inter, q, storage)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, config: DeepseekV41TextConfig):
        super().__init__()
        if config.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts={config.n_shared_experts}: V4.1 has exactly one shared expert")
        self.gate = Gate(config)
        self.experts = nn.ModuleList(Expert(config, "mxfp4") for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(config, "fp8")
        self.native = config.native_weights
        # the experts' tensors: bf16 `weight`, or native `weight` (packed E2M1) and `scale` (UE8M0)
        self.leaves = ("weight", "scale") if self.native else ("weight",)
        self.grouped = False  # set by stack_experts()
        self.shared_stacked = False  # the shared expert is the stacks' last slice (stack_experts(shared=True))
        self.few_rows = 0  # bf16 grouped GEMMs of at most this many rows run dsflash::grouped_mm (see _grouped_mm)
        self.count_order = 0  # pairs x (groups + 1) up to this: sorts by counting (see _expert_order); 0: argsort
        self.order_op = False  # with count_order: dsflash::expert_order where its kernel fits (compile() sets it)
        self.few_tokens = 0  # bf16 grouped: up to this many tokens run dsflash::routed_experts (compile() sets it)
        self.swiglu_op = False  # up to few_rows pairs: dsflash::grouped_swiglu (see _fused_swiglu; compile() sets it)
        self.token_sum_op = False  # the sorted path's per-token sum as dsflash::token_sum (compile() sets it)
        if self.native:
            self.stack_experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(x)
        if self.grouped and self.shared_stacked:  # the shared expert: one more pair per token (id E, weight 1)
            y = self._routed_grouped(x, weights, ids, shared=True, dtype=x.dtype)
        else:
            y = self.routed_and_shared(x, weights, ids)
        return y.to(x.dtype).view(shape)

    def routed_and_shared(self, x, weights, ids) -> torch.Tensor:
        """The routed experts' weighted sum (fp32) plus the shared expert's output (bf16), in fp32."""
        return self.routed(x, weights, ids) + self.shared_experts(x)

    def routed(self, x, weights, ids) -> torch.Tensor:
        """The routed experts' weighted sum per token, fp32 (parallel.py's ParallelMoE adds its collectives)."""
        return self._routed_grouped(x, weights, ids) if self.grouped else self._routed_loop(x, weights, ids)

    def _routed_loop(self, x, weights, ids) -> torch.Tensor:
        y = torch.zeros_like(x, dtype=torch.float32)
        # Token-by-expert loop in ascending expert id (the reference's summation order); id -1 marks a pair
        # routed to another rank's experts (parallel.py)
        for e in ids[ids >= 0].unique().tolist():
            token, slot = torch.where(ids == e)
            y[token] += self.experts[e](x[token], weights[token, slot, None])
        return y

    def stack_experts(self, shared: bool = False) -> None:
        """Hold each routed projection's tensors of all experts in one [E, ...] tensor; every expert's tensor
        becomes a view of its slice (no extra memory; names and checkpoints unchanged). Moving the model
        later keeps them views (see _apply). A stale stack (tensors assigned since) is rebuilt.
        shared: the shared expert becomes slice E ([E + 1, ...]; bf16 weights only, see can_stack_shared)."""
        if shared and not self.can_stack_shared():
            raise ValueError("stack_experts(shared=True): only a bf16 MoE without collectives can stack its shared "
                             "expert (native ones are FP8, the routed MXFP4; ParallelMoE reduces the routed part)")
        if self.shared_stacked and not shared:  # its own tensors again: its views would keep the old stacks alive
            for linear in (self.shared_experts.w1, self.shared_experts.w2, self.shared_experts.w3):
                hold(linear, "weight", linear.weight.detach().clone())
        self.shared_stacked = shared
        for name in ("w1", "w2", "w3"):
            for leaf in self.leaves:
                stacked = torch.stack([getattr(getattr(e, name), leaf).detach() for e in self._stacked()])
                self.register_buffer(f"{name}_{leaf}_stacked", stacked, persistent=False)  # not a checkpoint tensor
        self._view_experts()
        self.grouped = True

    def ensure_grouped(self, shared: bool = False) -> None:
        """Run the grouped path, the shared expert stacked or not: stack_experts(shared) unless the stacks already
        hold that layout and are current (compile(); eager callers that must not sync with the host per expert)."""
        if not self.grouped or self.shared_stacked != shared or self.stacks_stale():
            self.stack_experts(shared)

    def stacks_stale(self) -> bool:
        """Whether a stacked expert tensor is no longer a view of its stack (a load with assign=True replaced
        it): stack_experts() must run again before the grouped path reads the stacks."""
        return self.grouped and not all(
            same_storage(getattr(getattr(e, name), leaf), getattr(self, f"{name}_{leaf}_stacked"))
            for name in ("w1", "w2", "w3") for leaf in self.leaves for e in self._stacked())

    def can_stack_shared(self) -> bool:
        return not self.native

    def _stacked(self) -> list:
        """The experts whose tensors the stacks hold, in slice order."""
        return [*self.experts, self.shared_experts] if self.shared_stacked else list(self.experts)

    def _view_experts(self) -> None:
        for name in ("w1", "w2", "w3"):
            for leaf in self.leaves:
                stacked = getattr(self, f"{name}_{leaf}_stacked")
                for e, t in zip(self._stacked(), stacked):
                    hold(getattr(e, name), leaf, t)

    def _apply(self, fn, recurse=True):
        # .to()/.cuda() convert each expert's view and the stack separately: point the experts back at the
        # converted stack (else each expert would hold a second copy; for native weights on the GPU, of
        # the largest tensors of the model)
        super()._apply(fn, recurse)
        if self.grouped:
            self._view_experts()
        return self

    def _grouped_mm(self, xs: torch.Tensor, name: str, offsets: torch.Tensor) -> torch.Tensor:
        """xs [pairs, in] (sorted by expert) times each pair's expert's projection `name`."""
        if self.native:
            return torch.ops.dsflash.mxfp4_grouped_mm(xs, getattr(self, f"{name}_weight_stacked"),
                                                      getattr(self, f"{name}_scale_stacked"), offsets)
        # few rows per expert: dsflash::grouped_mm (the CUTLASS grouped GEMM reads weights slowly there), else
        # torch._grouped_mm; the op picks when it runs, so a symbolic row count (dynamic shapes) is not guarded
        return torch.ops.dsflash.grouped_mm_by_rows(xs, getattr(self, f"{name}_weight_stacked"), offsets,
                                                    self.few_rows)

    def _fused_swiglu(self, pairs) -> bool:
        """Whether the sorted path's gate/up half runs as dsflash::grouped_swiglu: bf16 stacks, swiglu_op set
        (compile() sets it) and a static pair count the few-row grouped GEMM takes (decode; a symbolic count,
        dynamic shapes, keeps the unfused path rather than guarding the graph on it)."""
        return self.swiglu_op and not self.native and isinstance(pairs, int) and pairs <= self.few_rows

    def _expert_order(self, key: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs sorted stably by key (expert id, `groups` for a pair no GEMM computes): order [pairs] and
        its inverse rank (pair p lands at rank[p]). Up to count_order pairs x (groups + 1) (compile() sets it:
        decode and short prefills), by counting: rank = the pairs of smaller keys + the earlier pairs of the
        same key, exactly the stable sort's, where Inductor fuses argsort into one single-program bitonic sort
        (H200, flash-40l-e8 B64: 39 us per layer, 448 pairs). The bound is a shape test: with dynamic shapes
        it guards the graph on the pair count (longer chunks compile the argsort graph)."""
        arange = torch.arange(key.numel(), device=key.device)
        if key.numel() * (groups + 1) <= self.count_order:
            onehot = (key == torch.arange(groups + 1, device=key.device).unsqueeze(1)).int()  # [groups + 1, pairs]
            sizes = onehot.sum(1)  # int64
            seen = onehot.cumsum(1, dtype=torch.int32).gather(0, key.unsqueeze(0)).squeeze(0)  # int32: half the scan
            rank = (sizes.cumsum(0) - sizes)[key] + seen - 1
            return torch.empty_like(rank).scatter_(0, rank, arange), rank
        order = key.argsort(stable=True)
        return order, torch.empty_like(order).scatter_(0, order, arange)

    def _slot_order(self, ids: torch.Tensor) -> torch.Tensor:
        """Each token's slots by ascending expert id, ties (-1: elsewhere) in slot order: argsort(stable=True)
        along dim 1. With count_order on, by counting: slot j's place is the number of its token's slots with a
        smaller id or an equal id before j (k x k compares at any size; argsort was a 27 us segmented sort per
        layer at 128 tokens on the H200)."""
        if not self.count_order:
            return ids.argsort(dim=1, stable=True)
        slots = torch.arange(ids.shape[1], device=ids.device)
        mine, other = ids.unsqueeze(2), ids.unsqueeze(1)  # [tokens, j, 1], [tokens, 1, i]
        place = ((other < mine) | ((other == mine) & (slots < slots.unsqueeze(1)))).sum(2)
        return torch.empty_like(place).scatter_(1, place, slots.expand_as(place))  # int64 like argsort's

    def _routed_grouped(self, x, weights, ids, shared: bool = False, dtype=torch.float32) -> torch.Tensor:
        """The routed experts as grouped GEMMs over (token, slot) pairs sorted by expert, summed per token in
        `dtype`. ids may be -1 (a pair another rank's experts take: ParallelMoE); such a pair sorts after every
        expert's pairs, past the last offset, so no GEMM computes it (shapes stay static), and it adds zero.
        shared: the stacked shared expert is one more pair per token (id E, weight 1). Up to few_tokens tokens,
        dsflash::routed_experts instead (no sort; it skips ids -1, adds the shared pair and quantizes x itself)."""
        first = self.experts[0]
        if not self.native and ids.shape[0] <= self.few_tokens:  # no sort: two launches on CUDA
            return torch.ops.dsflash.routed_experts(
                x, weights, ids, self.w1_weight_stacked, self.w3_weight_stacked, self.w2_weight_stacked, first.limit,
                first.w1.quantize_input, first.w2.quantize_input, len(self.experts) if shared else -1,
                dtype == torch.bfloat16).to(dtype)  # bf16: rounded in the op (no cast kernel before the seam)
        if shared:
            weights, ids = with_shared_expert(weights, ids, len(self.experts))
        tokens, k = ids.shape
        expert = ids.flatten()
        here = expert >= 0
        groups = len(self.experts) + self.shared_stacked
        if self.order_op and self.count_order and expert_order.kernel_fits(expert.numel(), groups):
            order, rank, offsets, ascending = torch.ops.dsflash.expert_order(ids, groups)  # one launch on CUDA
        else:
            order, rank = self._expert_order(torch.where(here, expert, groups), groups)
            counts = torch.zeros(groups, dtype=torch.int32, device=x.device)
            counts.scatter_add_(0, expert.clamp(min=0), here.to(torch.int32))
            offsets = counts.cumsum(0, dtype=torch.int32)
            ascending = self._slot_order(ids)  # each token's slots in ascending expert id (the sum's order below)
        xq = fp8_qdq(x) if first.w1.quantize_input else x
        if self._fused_swiglu(order.shape[0]):  # one launch on CUDA: gathers, two GEMMs, SwiGLU and FP8 of h
            h = torch.ops.dsflash.grouped_swiglu(xq, weights, order, self.w1_weight_stacked, self.w3_weight_stacked,
                                                 offsets, first.limit, first.w2.quantize_input)
        else:
            xs = xq[order // k]
            gate = self._grouped_mm(xs, "w1", offsets).float()
            up = self._grouped_mm(xs, "w3", offsets).float()
            if first.limit > 0:
                gate, up = gate.clamp(max=first.limit), up.clamp(-first.limit, first.limit)
            h = (weights.flatten()[order].unsqueeze(1) * (F.silu(gate) * up)).to(x.dtype)
            h = fp8_qdq(h) if first.w2.quantize_input else h
        out = self._grouped_mm(h, "w2", offsets)
        # back to each token's slots in ascending expert id, summed one by one (the loop's order)
        token_sum = torch.ops.dsflash.token_sum if self.token_sum_op else token_sum_reference
        return token_sum(out, rank, ascending, offsets, dtype)
