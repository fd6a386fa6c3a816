"""Attention of every layer (MODEL.md section 4): window ring + top-k compressed rows, sinks, grouped output.

A layer's role (config.layer_roles) decides what it owns: KV sources run a `Compressor` and write
compressed KV and index keys; index sources run an `Indexer` and publish a top-k; consumers read both
from the latest source of their ratio. The kv row (norm, RoPE, FP8), attention, cache writes, scoring and
top-k are `dsflash` ops.
"""

from __future__ import annotations

import torch
from torch import nn

from . import custom_ops  # noqa: F401  (registers torch.ops.dsflash)
from .cache import LayerCache
from .configuration_deepseek_v41 import DeepseekV41TextConfig, LayerRole
from .context import ForwardContext, GroupRows
from .layers import Linear, RMSNorm, keep_fused, quant_linear, view_outputs
from .pooling import softmax_pool
from .quant import fp4_qdq_e4m3, fp4_qdq_ue8m0
from .rope import apply_rope

ops = torch.ops.dsflash


def rope(x: torch.Tensor, rot: torch.Tensor, in_place: bool) -> torch.Tensor:
    """x rotated by rot: with in_place, x itself through dsflash::rope_ (a projection's fresh output: the compiled
    step then touches the rotated dims only), else rope.apply_rope's new tensor."""
    if in_place:
        ops.rope_(x, rot)
        return x
    return apply_rope(x, rot)


class Compressor(nn.Module):
    """Pools `ratio` consecutive tokens into one compressed row (KV sources only).

    Ratio 1: c_t = rms(wkv(u_t)). Ratio r > 1: per channel, a softmax over the group's r tokens of
    wgate(u) weights wkv(u) (both fp32); a group still filling waits in the cache's pending state.
    Returns the new rows (bf16, normalised, before RoPE) as `rows` (ctx.group_rows) lays them out."""

    def __init__(self, config: DeepseekV41TextConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        dtype = torch.float32 if ratio > 1 else torch.bfloat16  # the reference pools in fp32
        self.wkv = Linear(config.hidden_size, config.head_dim, dtype=dtype)
        if ratio > 1:
            self.wgate = Linear(config.hidden_size, config.head_dim, dtype=torch.float32)
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.wkv_gate = None  # wkv and wgate as one projection (fuse_projections)

    def fuse_projections(self, fuse: bool = True) -> None:
        """Ratio > 1: wkv and wgate read the same input: one fp32 projection for both, their tensors its views (as
        Attention.fuse_input_projections)."""
        if self.ratio > 1:
            self.wkv_gate = keep_fused(self.wkv_gate, (self.wkv, self.wgate), fuse)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # converts wkv's, wgate's and the fused tensors separately: views again
        if self.wkv_gate is not None:
            view_outputs(self.wkv_gate, (self.wkv, self.wgate))
        return self

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(kv, score) of the chunk's tokens: ratio 1 wkv(x) alone (bf16), else both fp32 (views of one
        projection where fused)."""
        if self.ratio == 1:
            return self.wkv(x), None
        if self.wkv_gate is not None:
            return self.wkv_gate(x).split(self.wkv.out_features, dim=-1)
        return self.wkv(x), self.wgate(x)

    def forward(self, x: torch.Tensor, rows: GroupRows, state: LayerCache) -> torch.Tensor:
        kv, score = self.project(x)
        if self.ratio == 1:
            return self.norm(kv)
        pooled = softmax_pool(kv, score, rows.source, rows.complete, state.pending_kv, state.pending_score)
        return self.norm(pooled.to(x.dtype))


class Indexer(nn.Module):
    """Lightning indexer (MODEL.md 4.2): scores visible compressed rows, publishes a top-k."""

    def __init__(self, config: DeepseekV41TextConfig, role: LayerRole):
        super().__init__()
        self.role = role
        self.heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk = config.index_topk
        self.candidate_blocks, self.candidate_block_size = config.candidate_topk_blocks, config.candidate_block_size
        self.quantize = config.quantize_dequantize
        self.wq_b = quant_linear(config, config.q_lora_rank, self.heads * self.head_dim, self.quantize)
        self.weights_proj = Linear(config.hidden_size, self.heads)
        if role.is_kv_source:
            self.wk = Linear(config.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # the query's RoPE and FP4 as dsflash::rope_fp4_qdq_, the keys' RoPE as dsflash::rope_, in place on fresh
        # buffers (compile() sets it)
        self.rope_op = False

    def keys(self, latent: torch.Tensor, rot: torch.Tensor, record_format: str) -> torch.Tensor:
        """Index keys of new compressed rows (from the unrotated latent), as `record_format` records store them.
        The FP4 QDQ is skipped where the "mxfp4" record's encoding is that QDQ itself (records.py)."""
        k = rope(self.k_norm(self.wk(latent)), rot, self.rope_op)
        return fp4_qdq_ue8m0(k) if self.quantize and record_format != "mxfp4" else k

    def forward(self, x, qr, ctx: ForwardContext, keys: torch.Tensor) -> torch.Tensor:
        batch, seq = ctx.positions.shape
        ratio, num_rows = self.role.ratio, ctx.num_rows(self.role.ratio)
        if num_rows == 0:
            return torch.full((batch, seq, 0), -1, dtype=torch.int32, device=x.device)
        q = self.wq_b(qr).unflatten(-1, (self.heads, self.head_dim))
        if self.rope_op and self.quantize:
            ops.rope_fp4_qdq_(q, ctx.rotations["compressed"])
        else:
            q = rope(q, ctx.rotations["compressed"], self.rope_op)
            q = fp4_qdq_ue8m0(q) if self.quantize else q
        weights = self.weights_proj(x) * (self.head_dim ** -0.5 * self.heads ** -0.5)
        visible, fmt, k = ctx.visible(ratio), ctx.cache.index_format, min(self.topk, num_rows)
        keys = keys[:batch, :num_rows]
        if self.role.uses_candidates:  # level two: score only the candidate rows, top-k among them
            scores = ops.candidate_scores(q, weights, keys, ctx.candidates, self.candidate_block_size, visible, fmt)
            return ops.candidate_topk(scores, ctx.candidates, self.candidate_block_size, k)
        scores = ops.indexer_scores(q, weights, keys, visible, num_rows, fmt)  # reads the records in place
        if self.role.is_candidate_source:  # level one: publish the best blocks (ids, compact)
            ctx.candidates = ops.candidate_blocks(scores, visible, self.candidate_blocks, self.candidate_block_size)
        return ops.topk_indices(scores, k, visible)


class Attention(nn.Module):
    def __init__(self, config: DeepseekV41TextConfig, role: LayerRole):
        super().__init__()
        self.role = role
        self.heads, self.head_dim, self.rope_dim = config.num_attention_heads, config.head_dim, config.qk_rope_head_dim
        self.groups, self.o_rank = config.o_groups, config.o_lora_rank
        self.quantize = config.quantize_dequantize
        self.emulate_stale_keys = config.emulate_reference_index_key_pointer
        eps = config.rms_norm_eps
        self.wq_a = quant_linear(config, config.hidden_size, config.q_lora_rank, self.quantize)
        self.q_norm = RMSNorm(config.q_lora_rank, eps)
        self.wq_b = quant_linear(config, config.q_lora_rank, self.heads * self.head_dim, self.quantize)
        self.wkv = quant_linear(config, config.hidden_size, self.head_dim, self.quantize)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        # Block-diagonal over groups: each group projects only its own heads.
        self.wo_a = quant_linear(config, self.heads * self.head_dim // self.groups, self.groups * self.o_rank, False,
                                 groups=self.groups)
        self.wo_b = quant_linear(config, self.groups * self.o_rank, config.hidden_size, self.quantize)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        self.compressor = Compressor(config, role.ratio) if role.is_kv_source else None
        self.indexer = Indexer(config, role) if role.is_index_source else None
        self.wqkv_a = None  # wq_a and wkv as one projection (fuse_input_projections)
        self.rope_op = False  # q's RoPE as dsflash::rope_, in place (compile() sets it)
        self.norms_op = False  # q's norm in kv's launch, dsflash::qkv_norm_rope, where no query is trimmed (same)
        self.ring_write_op = False  # one-token steps write the ring in kv's launch, dsflash::kv_norm_rope_write_ (same)
        self.own_key_op = False  # one-token steps leave the key row to the attention's launch (same bits)
        self.compress_op = False  # one-token steps run the compressor after its projection as dsflash::compress_token_

    def fuse_input_projections(self, fuse: bool = True) -> None:
        """wq_a and wkv read the same quantized input: hold them as one projection (their tensors become views of
        its own, outside the checkpoint), so a decode step runs one GEMV for both. fuse=False: two again (the
        views keep exactly the fused tensors' bytes alive). Fusing a fused layer again keeps its tensors while
        wq_a's and wkv's are still their views: decode graphs captured by an earlier compile() read them (a
        load that replaced wq_a or wkv fuses anew; so does fusing after fuse=False)."""
        self.wqkv_a = keep_fused(self.wqkv_a, (self.wq_a, self.wkv), fuse)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # converts wq_a's, wkv's and the fused tensors separately: views again
        if self.wqkv_a is not None:
            view_outputs(self.wqkv_a, (self.wq_a, self.wkv))
        return self

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: LayerCache, topk: torch.Tensor | None,
                queries: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x [B, S, D] -> (output [B, S, D], the top-k it attended: its own if it is an index source,
        else `topk`, the latest index source's of its ratio). queries: only the last `queries` columns'
        outputs are wanted (bounded replay at the last KV source): the keys and cache writes still cover
        every column, the query side runs on those columns only and the output is [B, queries, D]; 0: the
        cache writes alone (returns None and `topk`)."""
        batch = x.shape[0]
        role, cache = self.role, ctx.cache

        if self.wqkv_a is not None:
            q_a, kv_a = self.wqkv_a(x).split([self.wq_a.out_features, self.wkv.out_features], dim=-1)
        else:
            q_a, kv_a = self.wq_a(x), self.wkv(x)
        # kv_norm, RoPE of the tail, then (quantized) FP8 over all dims, RoPE tail included: the window's K = V
        rot, qr, ring = ctx.rotations[role.rope_kind], None, state.window
        # one token a row: the ring slot it goes to holds no key of the step (its window ends at the token itself,
        # read from kv), so it is written in the norm's launch, before the attention, or in the attention's own
        # launch, which then makes the row too (own_key)
        own_key = self.own_key_op and x.shape[1] == 1 and queries is None
        ring_first = (self.ring_write_op and x.shape[1] == 1) or own_key
        if own_key:
            kv = None
        elif self.norms_op and queries is None and ring_first:
            qr, kv = ops.qkv_norm_rope_write_(ring, ctx.window_slots, cache.window_format, q_a, self.q_norm.weight,
                                              kv_a, self.kv_norm.weight, self.kv_norm.eps, rot, self.quantize)
        elif self.norms_op and queries is None:
            qr, kv = ops.qkv_norm_rope(q_a, self.q_norm.weight, kv_a, self.kv_norm.weight, self.kv_norm.eps, rot,
                                       self.quantize)
        elif ring_first:
            kv = ops.kv_norm_rope_write_(ring, ctx.window_slots, cache.window_format, kv_a, self.kv_norm.weight,
                                         self.kv_norm.eps, rot, self.quantize)
        else:
            kv = ops.kv_norm_rope(kv_a, self.kv_norm.weight, self.kv_norm.eps, rot, self.quantize)
        keys = state.index_keys
        if role.ratio and self.compressor is not None:
            wrote = self._compress(x, ctx, state)
            if self.emulate_stale_keys:
                keys = cache.index_keys[self._reference_key_layer(cache, wrote)]
        if queries == 0:
            if not ring_first:
                ops.record_write_(ring, kv, ctx.window_slots, cache.window_format)
            return None, topk

        whole = ctx  # the chunk's context (the cache writes); ctx becomes the queries'
        if queries is not None:
            x, q_a, ctx = x[:, -queries:], q_a[:, -queries:], ctx.last_columns(queries)
        qr = self.q_norm(q_a) if qr is None else qr
        q = self.wq_b(qr).unflatten(-1, (self.heads, self.head_dim))
        q = rope(q, ctx.rotations[role.rope_kind], self.rope_op)
        if role.ratio:
            if self.indexer is not None:
                topk = self.indexer(x, qr, ctx, keys)
                if ctx is not whole:  # a candidate source publishes into the context it is given
                    whole.candidates = ctx.candidates
            compressed, cidx = state.compressed[:batch], topk
        else:
            compressed, cidx = ring[:batch, :0], ctx.window_idx.new_zeros(ctx.window_idx.shape[:2] + (0,))
        # sparse attention over the ring (+ this chunk's kv) and the top-k compressed rows, read from
        # their records; the inverse RoPE of the output (V = K carries the rotation) is fused in
        o = torch.empty_like(q)
        compressed_format = cache.compressed_format if role.ratio else cache.window_format
        if own_key:  # early: kv comes from the launch of q's input projection, wq_b's launch between (the op's notes)
            ops.attention_own_key_(o, ring, q, kv_a, self.kv_norm.weight, self.kv_norm.eps, rot, self.quantize,
                                   ctx.window_slots, ctx.window_idx, compressed, cidx, self.attn_sink, ctx.positions,
                                   ctx.inv_freq[role.rope_kind], self.head_dim ** -0.5, cache.window_format,
                                   compressed_format, early=self.wqkv_a is not None)
        else:
            ops.attention_(o, q, ring[:batch], kv, ctx.window_idx, compressed, cidx, self.attn_sink, ctx.positions,
                           ctx.inv_freq[role.rope_kind], self.head_dim ** -0.5, cache.window_format, compressed_format)
        if not ring_first:
            ops.record_write_(ring, kv, whole.window_slots, cache.window_format)

        return self.wo_b(self.wo_a(o.flatten(2))), topk

    def _reference_key_layer(self, cache, wrote: torch.Tensor) -> int:
        """Which layer's index keys this KV source scores. Its own, unless the config emulates the
        reference's stale pointer: there a source whose group is still filling (no new row in this
        forward) scores the keys of the last source that did write rows (see the config field). A host
        sync: eager only (compile() refuses the option)."""
        if bool(wrote.any()):
            cache.last_index_key_writer = self.role.layer
            return self.role.layer
        return cache.last_index_key_writer if cache.last_index_key_writer is not None else self.role.layer

    def _compress(self, x: torch.Tensor, ctx: ForwardContext, state: LayerCache) -> torch.Tensor:
        """New compressed rows: index keys from the unrotated latent, then RoPE at the group's first
        position, FP4 quantize-dequantize, and both written to the cache."""
        cache, rows = ctx.cache, ctx.group_rows(self.role.ratio)
        if self.compress_op and x.shape[1] == 1 and x.dtype == torch.bfloat16:  # all of it in one launch
            kv, score = self.compressor.project(x)
            idx = self.indexer  # its keys' projection and norm (a KV source without one writes no keys)
            ops.compress_token_(state.compressed, state.index_keys if idx else None, state.pending_kv,
                                state.pending_score, kv, score, rows.source, rows.complete, rows.row_ids, rows.rot,
                                self.compressor.norm.weight, self.compressor.norm.eps, idx.wk.weight if idx else None,
                                idx.k_norm.weight if idx else None, idx.k_norm.eps if idx else 0.0, self.quantize,
                                cache.compressed_format, cache.index_format)
            return rows.row_ids >= 0
        latent = self.compressor(x, rows, state)
        if self.indexer is not None:
            keys = self.indexer.keys(latent, rows.rot, cache.index_format)
            ops.record_write_(state.index_keys, keys, rows.row_ids, cache.index_format)
        latent = apply_rope(latent, rows.rot)
        if self.quantize and cache.compressed_format != "nvfp4":  # an nvfp4 record's encoding is this QDQ
            latent = fp4_qdq_e4m3(latent)
        ops.record_write_(state.compressed, latent, rows.row_ids, cache.compressed_format)
        return rows.row_ids >= 0
