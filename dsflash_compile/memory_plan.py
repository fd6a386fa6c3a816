"""Memory plan (est): what DeepSeek-V4.1-Flash holds with native weights, and how many requests fit on N GPUs.

Every figure is computed from the config and the code's own formats, not measured:
  - `native_tensors`: each tensor the model holds with `weights="native"` (name, shape, dtype), its formats
    from checkpoint.py's table: FP8 E4M3 32x32 tiles, packed MXFP4 routed experts, FP8-row Engram tables,
    UE8M0 scales, bf16 / fp32 as the model keeps them, plus the buffers it computes. The loader skips
    `mtp.*` (draft layers) and the vision tower, so neither is held. tests/test_memory_plan.py checks every
    tensor against a model built on the meta device.
  - `request_cache_bytes`: one request's row of the static cache (cache.py), packed records at `context`.
  - `plan`: per-GPU weight bytes (rank 0, the largest share) under a parallel layout (parallel.py), the
    Engram tables on every GPU, split over the GPUs, or in host memory, and the requests that fit.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import torch

from . import checkpoint, parallel
from .cache import CUDA_CACHE_FORMATS, DeepseekV41Cache, growing_bytes_per_token
from .configuration_deepseek_v41 import DeepseekV41TextConfig
from .pretrained import to_official

GIB = 2 ** 30
H200_GIB = 139  # usable per H200 (of its 141 GB)
CACHE_FORMATS = {f"{kind}_format": fmt for kind, fmt in CUDA_CACHE_FORMATS.items()}  # DeepseekV41Cache's kwargs

# name -> group, first match wins; anything else is a replicated dense tensor
GROUPS = ("routed experts", "attention (TP-split)", "shared experts", "dense (replicated)", "embed + head",
          "engram tables", "buffers")
_GROUP_OF = (
    ("routed experts", re.compile(r"\.ffn\.(experts\.\d+\.|w[123]_(weight|scale)_stacked$)")),
    ("engram tables", re.compile(r"\.engram\.embed\.")),
    ("shared experts", re.compile(r"\.ffn\.shared_experts\.")),
    ("attention (TP-split)", re.compile(r"\.attn\.(wq_b\.|wo_a\.|wo_b\.|attn_sink$)")),
    ("embed + head", re.compile(r"^(model\.embed|head)\.weight$")),
    ("buffers", re.compile(r"^model\.(engram_token_map|\w+_inv_freq)$")),
)
# TP's split dim by name; routed experts are TP-split only when ep == 1 (as parallel.py shards: gpu_bytes is
# checked against parallelize, tests/test_memory_plan.py)
_TP_DIM = ((re.compile(r"\.attn\.(wq_b\.|wo_a\.|attn_sink$)|experts(\.\d+)?\.w[13]\."), 0),
           (re.compile(r"\.attn\.wo_b\.|experts(\.\d+)?\.w2\."), 1))
_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")
ENGRAM = ("host", "gpu", "gpu-split")  # host memory (planned); every GPU (today); rows split over GPUs (planned)


@dataclass(frozen=True)
class TensorSpec:
    name: str  # the model's name (checkpoint name = pretrained.to_official(name))
    shape: tuple
    dtype: torch.dtype
    persistent: bool = True  # False: a buffer the model computes (not in the checkpoint)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @cached_property
    def group(self) -> str:
        return group_of(self.name)

    @cached_property
    def tp_dim(self) -> int | None:
        """The dim TP splits (parallel.py's shard_attention, shard_expert); None: replicated."""
        return next((dim for pattern, dim in _TP_DIM if pattern.search(self.name)), None)

    @cached_property
    def expert(self) -> int | None:
        """The routed expert this tensor belongs to."""
        found = _EXPERT_ID.search(self.name) if self.group == "routed experts" else None
        return int(found[1]) if found else None


def group_of(name: str) -> str:
    return next((group for group, pattern in _GROUP_OF if pattern.search(name)), "dense (replicated)")


# -- the tensors, module by module (the model's names and shapes) ------------------------------------------
def _held(name: str, shape: tuple, dtype: torch.dtype | None = None) -> TensorSpec:
    """A tensor in the release's storage dtype, unless the model holds it as `dtype`."""
    return TensorSpec(name, tuple(shape), dtype or checkpoint.official_dtype(to_official(name)))


def _quantized(name: str, out_features: int, in_features: int) -> list[TensorSpec]:
    """A projection held as stored: codes (packed E2M1 has two inputs a byte) and UE8M0 scales."""
    fmt = checkpoint.weight_format(to_official(name) + ".weight")
    logical = (out_features, in_features)
    codes = (out_features, in_features // 2) if fmt == checkpoint.MXFP4 else logical
    return [_held(f"{name}.weight", codes), _held(f"{name}.scale", checkpoint.scale_shape(fmt, logical))]


def _attention(p: str, t: DeepseekV41TextConfig, role) -> list[TensorSpec]:
    d, dim, heads = t.head_dim, t.hidden_size, t.num_attention_heads
    specs = [*_quantized(f"{p}.wq_a", t.q_lora_rank, dim), _held(f"{p}.q_norm.weight", (t.q_lora_rank,)),
             *_quantized(f"{p}.wq_b", heads * d, t.q_lora_rank), *_quantized(f"{p}.wkv", d, dim),
             _held(f"{p}.kv_norm.weight", (d,)),
             *_quantized(f"{p}.wo_a", t.o_groups * t.o_lora_rank, heads * d // t.o_groups),
             *_quantized(f"{p}.wo_b", dim, t.o_groups * t.o_lora_rank), _held(f"{p}.attn_sink", (heads,))]
    if role.is_kv_source:
        pooled = torch.float32 if role.ratio > 1 else None  # the model pools in fp32; the release stores bf16
        specs += [_held(f"{p}.compressor.wkv.weight", (d, dim), pooled), _held(f"{p}.compressor.norm.weight", (d,))]
        if role.ratio > 1:
            specs.append(_held(f"{p}.compressor.wgate.weight", (d, dim), pooled))
    if role.is_index_source:
        q, di = f"{p}.indexer", t.index_head_dim
        specs += [*_quantized(f"{q}.wq_b", t.index_n_heads * di, t.q_lora_rank),
                  _held(f"{q}.weights_proj.weight", (t.index_n_heads, dim))]
        if role.is_kv_source:
            specs += [_held(f"{q}.wk.weight", (di, d)), _held(f"{q}.k_norm.weight", (di,))]
    return specs


def _moe(p: str, t: DeepseekV41TextConfig) -> list[TensorSpec]:
    n, dim, inter = t.n_routed_experts, t.hidden_size, t.moe_intermediate_size
    specs = [_held(f"{p}.gate.weight", (n, dim)), _held(f"{p}.gate.bias", (n,)), _held(f"{p}.gate.bias_vl", (n,))]
    for expert in [f"{p}.experts.{e}" for e in range(n)] + [f"{p}.shared_experts"]:
        specs += [*_quantized(f"{expert}.w1", inter, dim), *_quantized(f"{expert}.w2", dim, inter),
                  *_quantized(f"{expert}.w3", inter, dim)]
    return specs


def _engram(p: str, t: DeepseekV41TextConfig, rows: int) -> list[TensorSpec]:
    cols = (t.engram_max_ngram_size - 1) * t.engram_n_heads * t.engram_head_dim
    return [*_quantized(f"{p}.embed", rows, t.engram_head_dim),
            *_quantized(f"{p}.wkv", t.hidden_size * (t.hc_mult + 1), cols),
            _held(f"{p}.q_weight", (t.hc_mult, t.hidden_size)), _held(f"{p}.k_weight", (t.hc_mult, t.hidden_size))]


def _block(p: str, t: DeepseekV41TextConfig, role, engram_rows: int | None) -> list[TensorSpec]:
    hc, dim = t.hc_mult, t.hidden_size
    specs = []
    for seam in ("attn", "ffn"):
        specs += [_held(f"{p}.hc_{seam}_fn", ((2 + hc) * hc, hc * dim)), _held(f"{p}.hc_{seam}_base", ((2 + hc) * hc,)),
                  _held(f"{p}.hc_{seam}_scale", (3,))]
    specs += [_held(f"{p}.attn_norm.weight", (dim,)), *_attention(f"{p}.attn", t, role),
              _held(f"{p}.ffn_norm.weight", (dim,)), *_moe(f"{p}.ffn", t)]
    return specs + (_engram(f"{p}.engram", t, engram_rows) if engram_rows is not None else [])


def native_tensors(text: DeepseekV41TextConfig) -> list[TensorSpec]:
    """Every tensor DeepseekV41ForCausalLM holds with weights="native" (routed experts by their own names: the
    MoE's stacks are views of them, no extra memory), then the buffers it computes."""
    vocab, dim = text.vocab_size, text.hidden_size
    rows = dict(zip(text.engram_layer_ids, text.engram_num_embeddings))
    specs = [_held("model.embed.weight", (vocab, dim))]
    for role in text.layer_roles:
        specs += _block(f"model.layers.{role.layer}", text, role, rows.get(role.layer))
    specs += [_held("model.norm.weight", (dim,)), _held("head.weight", (vocab, dim))]
    rope = (text.qk_rope_head_dim // 2,)
    return specs + [TensorSpec("model.engram_token_map", (vocab,), torch.int64, False),
                    TensorSpec("model.window_inv_freq", rope, torch.float32, False),
                    TensorSpec("model.compressed_inv_freq", rope, torch.float32, False)]


def by_group(specs, nbytes=lambda s: s.nbytes) -> dict:
    totals = Counter()
    for s in specs:
        totals[s.group] += nbytes(s)
    return {group: totals[group] for group in GROUPS}


def stored_nbytes(spec: TensorSpec) -> int:
    """Bytes of `spec` in the release's files (its official dtype; 0 for a buffer the model computes)."""
    return math.prod(spec.shape) * checkpoint.official_dtype(to_official(spec.name)).itemsize if spec.persistent else 0


# -- caches ----------------------------------------------------------------------------------------------
def request_cache_bytes(text: DeepseekV41TextConfig, context: int) -> int:
    """One request's row of the static cache at `context` tokens, CUDA's record formats (on meta: no memory)."""
    return DeepseekV41Cache(text, 1, context, device="meta", **CACHE_FORMATS).memory_bytes()


# -- the plan --------------------------------------------------------------------------------------------
def _chunk_bytes(spec: TensorSpec, dim: int, parts: int) -> int:
    """Bytes of rank 0's piece (torch.chunk's first, the largest) of `spec` split `parts` ways along `dim`."""
    shape = list(spec.shape)
    shape[dim] = math.ceil(shape[dim] / parts)
    return math.prod(shape) * spec.dtype.itemsize


def gpu_bytes(spec: TensorSpec, layout: parallel.ParallelConfig, gpus: int, engram: str, experts: int) -> int:
    """Bytes of `spec` on rank 0 of `gpus` under `layout` (of `experts` routed experts), the Engram tables
    placed as `engram`."""
    group = spec.group
    if group == "engram tables":
        return {"host": 0, "gpu": spec.nbytes, "gpu-split": _chunk_bytes(spec, 0, gpus)}[engram]
    if group == "routed experts" and layout.ep > 1:  # rank 0 keeps the first experts / ep whole
        return spec.nbytes if spec.expert < experts // layout.ep else 0
    if layout.tp > 1 and spec.tp_dim is not None:
        return _chunk_bytes(spec, spec.tp_dim, layout.tp)
    return spec.nbytes


def layout_config(name: str, gpus: int, text: DeepseekV41TextConfig) -> parallel.ParallelConfig:
    config = parallel.layout(name, gpus)  # names an unknown layout, or a GPU count it cannot use
    config.validate(text, gpus)  # names what does not divide (experts by ep, heads by tp, ...)
    return config


def plan(text: DeepseekV41TextConfig, gpus=(4, 8), contexts=(131072, 1048576), layouts=("dp+ep", "tp+ep"),
         engram=ENGRAM, gpu_gib: float = H200_GIB, reserve_gib: float = 0.0) -> list[dict]:
    """One row per (GPUs, layout, Engram placement): rank 0's weight bytes per group, what is left for caches
    after `reserve_gib` (activations, workspace: not computed here), and the requests of each context that fit
    per GPU and per node (DP attention: each GPU its own requests; TP: every GPU holds every request's cache)."""
    for place in engram:
        if place not in ENGRAM:
            raise ValueError(f"unknown Engram placement {place!r}; choose one of {', '.join(ENGRAM)}")
    if min(gpus) < 1:
        raise ValueError(f"gpus {min(gpus)} must be >= 1")
    configs, unusable = {}, []
    for n in gpus:
        for name in layouts:
            try:
                configs[n, name] = layout_config(name, n, text)
            except ValueError as error:  # a layout for other GPU counts (1gpu at 4, dp+ep at 1) is left out
                if name not in parallel.LAYOUT_NAMES or parallel.layout_fits(name, n):
                    raise
                unusable.append(error)
    if not configs:
        raise unusable[0]
    for context in contexts:
        if context < 1:
            raise ValueError(f"context {context} must be >= 1 token")
    if gpu_gib <= 0 or reserve_gib < 0:
        raise ValueError(f"gpu_gib ({gpu_gib}) must be > 0 and reserve_gib ({reserve_gib}) >= 0")
    # the layers repeat: place each kind of tensor once (~2K kinds of the release's 93K tensors), times its count
    kinds = {}  # what gpu_bytes reads -> [one such tensor, count]
    for s in native_tensors(text):
        kinds.setdefault((s.group, s.shape, s.dtype, s.expert, s.tp_dim), [s, 0])[1] += 1
    caches = {context: request_cache_bytes(text, context) for context in contexts}
    table_bytes = sum(s.nbytes * count for s, count in kinds.values() if s.group == "engram tables")
    rows = []
    for n in gpus:
        for name in layouts:
            if (n, name) not in configs:
                continue
            layout = configs[n, name]
            for place in engram:
                groups = dict.fromkeys(GROUPS, 0)
                for s, count in kinds.values():
                    groups[s.group] += count * gpu_bytes(s, layout, n, place, text.n_routed_experts)
                weights = sum(groups.values())
                free = (gpu_gib - reserve_gib) * GIB - weights
                row = {"gpus": n, "layout": name, "tp": layout.tp, "ep": layout.ep, "dp_attention": layout.dp_attention,
                       "engram": place, "weights_gib_est": weights / GIB, "free_gib_est": free / GIB,
                       "weights_fit": free > 0, "host_gib_est": table_bytes / GIB if place == "host" else 0.0,
                       "groups_gib_est": {g: b / GIB for g, b in groups.items()}}
                for context, per_request in caches.items():
                    per_gpu = max(int(free // per_request), 0)
                    row[f"requests_per_gpu_{context}_est"] = per_gpu
                    row[f"requests_per_node_{context}_est"] = per_gpu * (n if layout.dp_attention else 1)
                rows.append(row)
    return rows


def summary(text: DeepseekV41TextConfig, contexts=(131072, 1048576)) -> dict:
    """The model-level figures the plan rests on (est)."""
    specs = native_tensors(text)
    return {"native_gib_est": {g: b / GIB for g, b in by_group(specs).items()},
            "native_total_gib_est": sum(s.nbytes for s in specs) / GIB,
            "checkpoint_gib_est": {g: b / GIB for g, b in by_group(specs, stored_nbytes).items()},
            "cache_bytes_per_token_est": growing_bytes_per_token(text, CACHE_FORMATS["compressed_format"],
                                                                 CACHE_FORMATS["index_format"]),
            "request_cache_gib_est": {str(c): request_cache_bytes(text, c) / GIB for c in contexts},
            "not_held": "mtp.* draft layers and the vision tower (the loader skips them)"}
