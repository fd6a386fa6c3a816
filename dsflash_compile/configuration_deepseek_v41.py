"""DeepSeek-V4.1-Flash configuration: the released `config.json` read as is.

The release nests the backbone under `text_config` (and a vision tower under `vision_config`), so the
top-level `DeepseekV41Config` is a composite config and the model reads `config.text_config`.
Every layer's role (MODEL.md section 1) is derived from the schedule fields and validated here, with
errors that name the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedConfig


class ScheduleError(ValueError):
    """A schedule field of the text config is inconsistent; the message names the field."""


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer owns and reads (MODEL.md section 1)."""

    layer: int
    ratio: int  # 0: window only; >0: also reads compressed KV of this ratio
    is_kv_source: bool  # owns a compressor, compressed KV rows and index keys
    is_index_source: bool  # runs an indexer and publishes a top-k
    is_candidate_source: bool  # also publishes candidate blocks (level 1)
    uses_candidates: bool  # an index source that scores only inside the published candidates (level 2)
    kv_layer: int | None  # the KV source whose compressed KV (and index keys) this layer reads
    topk_layer: int | None  # the index source whose top-k this layer's attention uses
    has_engram: bool  # Engram runs before this layer

    @property
    def rope_kind(self) -> str:
        return "compressed" if self.ratio > 0 else "window"


class DeepseekV41TextConfig(PreTrainedConfig):
    model_type = "deepseek_v41_text"
    base_config_key = "text_config"

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    sliding_window: int = 128
    compress_ratios: list | None = None
    kv_source_layer_ids: list | None = None
    index_source_layer_ids: list | None = None
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: list | None = None
    engram_num_embeddings: list | None = None
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: list | None = None
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    # Ours (not in the release): the release's quantize-dequantize points (MODEL.md section 6).
    # On by default so outputs match the reference; off gives plain bf16 numerics.
    quantize_dequantize: bool = True
    # Ours: reproduce a quirk of DeepSeek's reference decode, for bit-comparisons with its outputs only.
    # There the index keys are handed on through one shared pointer that a KV source updates only when it
    # writes a compressed row, so a ratio-2 source whose group is still filling scores the previous
    # writer's keys (layer 20's in the release). Off (default): every source scores its own keys.
    emulate_reference_index_key_pointer: bool = False
    # Ours: SWA bounded replay (SYSTEM.md), approximate by design. In a prompt chunk longer than the window
    # whose caller needs at most the last `sliding_window` outputs, the layers after the last KV source run
    # only on the last `sliding_window` tokens, their window attention seeing nothing below the first.
    # Off: every layer runs on every token (equal to full recomputation).
    swa_bounded_replay: bool = True
    # Ours: how the quantized projections are held in memory. "native": as the release stores them (FP8
    # E4M3 + UE8M0 32x32 tile scales; routed experts packed MXFP4), multiplied by the dsflash ops;
    # "bf16": dequantized (exactly) to bf16 at load. None: from_pretrained picks native on CUDA and bf16
    # elsewhere; a model built directly from a config holds bf16. Both give the same values.
    weights: str | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                     "engram_num_embeddings", "dspark_target_layer_ids"):
            if getattr(self, name) is None:
                setattr(self, name, [])
        if not self.compress_ratios:
            self.compress_ratios = [0] * (self.num_hidden_layers + self.num_nextn_predict_layers)
        if self.rope_scaling is None:
            self.rope_scaling = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                 "original_max_position_embeddings": 65536}
        self.validate_schedule()

    @property
    def native_weights(self) -> bool:
        """The quantized projections are held in their release formats (`weights == "native"`)."""
        return self.weights == "native"

    # -- roles -------------------------------------------------------------------------------------
    @property
    def layer_roles(self) -> list[LayerRole]:
        roles = []
        kv_sources = set(self.kv_source_layer_ids)
        index_sources = set(self.index_source_layer_ids)
        cand = self.candidate_source_layer_id
        cand = None if cand is None or cand < 0 else cand
        latest_kv: dict[int, int] = {}
        latest_topk: dict[int, int] = {}
        for layer in range(self.num_hidden_layers):
            ratio = self.compress_ratios[layer]
            if layer in kv_sources:
                latest_kv[ratio] = layer
            if layer in index_sources:
                latest_topk[ratio] = layer
            is_index = layer in index_sources
            roles.append(LayerRole(
                layer=layer,
                ratio=ratio,
                is_kv_source=layer in kv_sources,
                is_index_source=is_index,
                is_candidate_source=layer == cand,
                uses_candidates=(is_index and cand is not None and layer > cand
                                 and ratio == self.compress_ratios[cand]),
                kv_layer=latest_kv.get(ratio) if ratio > 0 else None,
                topk_layer=latest_topk.get(ratio) if ratio > 0 else None,
                has_engram=layer in self.engram_layer_ids,
            ))
        return roles

    @property
    def last_kv_source_layer(self) -> int:
        """Layers after this one own no growing state (what decoder-side bounded replay relies on)."""
        return max(self.kv_source_layer_ids, default=-1)

    # -- validation --------------------------------------------------------------------------------
    def validate_schedule(self) -> None:
        n = self.num_hidden_layers

        def fail(field: str, why: str):
            raise ScheduleError(f"DeepseekV41TextConfig.{field}: {why}")

        expected = n + self.num_nextn_predict_layers
        if len(self.compress_ratios) != expected:
            fail("compress_ratios", f"has {len(self.compress_ratios)} entries; expected num_hidden_layers "
                 f"({n}) + num_nextn_predict_layers ({self.num_nextn_predict_layers}) = {expected}")
        for layer, ratio in enumerate(self.compress_ratios):
            if not isinstance(ratio, int) or ratio < 0:
                fail("compress_ratios", f"entry {layer} is {ratio!r}; ratios are integers >= 0")
        for field in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, field)
            if sorted(set(ids)) != list(ids):
                fail(field, f"{ids} must be strictly increasing")
            for layer in ids:
                if not 0 <= layer < n:
                    fail(field, f"layer {layer} is outside 0..{n - 1}")
        for field in ("kv_source_layer_ids", "index_source_layer_ids"):
            for layer in getattr(self, field):
                if self.compress_ratios[layer] == 0:
                    fail(field, f"layer {layer} has compress_ratios[{layer}] = 0; a source needs a ratio > 0")
        kv, index = set(self.kv_source_layer_ids), set(self.index_source_layer_ids)
        for layer in kv - index:
            fail("index_source_layer_ids", f"KV source layer {layer} must also be an index source "
                 "(it owns the index keys)")
        for layer in range(n):
            ratio = self.compress_ratios[layer]
            if ratio == 0:
                continue
            if not any(s <= layer and self.compress_ratios[s] == ratio for s in kv):
                fail("compress_ratios", f"layer {layer} has ratio {ratio} but no KV source of ratio {ratio} "
                     f"at or below it in kv_source_layer_ids {sorted(kv)}")
            if not any(s <= layer and self.compress_ratios[s] == ratio for s in index):
                fail("compress_ratios", f"layer {layer} has ratio {ratio} but no index source of ratio {ratio} "
                     f"at or below it in index_source_layer_ids {sorted(index)}")
        cand = self.candidate_source_layer_id
        if cand is not None and cand >= 0:
            if cand not in kv or cand not in index:
                fail("candidate_source_layer_id", f"layer {cand} must be both a KV source and an index source")
            if self.candidate_topk_blocks * self.candidate_block_size < self.index_topk:
                fail("candidate_topk_blocks", f"{self.candidate_topk_blocks} blocks x candidate_block_size "
                     f"{self.candidate_block_size} = {self.candidate_topk_blocks * self.candidate_block_size} "
                     f"candidates cannot hold index_topk = {self.index_topk}")
        if self.num_attention_heads % self.o_groups:
            fail("o_groups", f"num_attention_heads {self.num_attention_heads} is not divisible by o_groups "
                 f"{self.o_groups}")
        if self.num_key_value_heads != 1:
            fail("num_key_value_heads", f"is {self.num_key_value_heads}; the model has one shared K=V latent")
        if not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", f"{self.qk_rope_head_dim} must be even and in 1..head_dim ({self.head_dim})")
        if self.qk_rope_head_dim > self.index_head_dim:
            fail("qk_rope_head_dim", f"{self.qk_rope_head_dim} exceeds index_head_dim {self.index_head_dim}")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("num_experts_per_tok", f"{self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            fail("engram_num_embeddings", f"has {len(self.engram_num_embeddings)} entries for "
                 f"{len(self.engram_layer_ids)} engram_layer_ids")
        if self.engram_layer_ids and self.engram_head_dim % 32 and self.quantize_dequantize:
            fail("engram_head_dim", f"{self.engram_head_dim} must be a multiple of 32 (FP8 groups of 32)")
        if self.weights not in (None, "native", "bf16"):
            fail("weights", f"{self.weights!r} must be 'native' (the release's FP8/MXFP4 storage), 'bf16' or None")
        if self.sliding_window <= 0:
            fail("sliding_window", f"{self.sliding_window} must be positive")
        if self.scoring_func != "sqrtsoftplus":
            fail("scoring_func", f"{self.scoring_func!r} is not supported; V4.1 routes with 'sqrtsoftplus'")


class DeepseekV41VisionConfig(PreTrainedConfig):
    """Kept so the released config round-trips; the vision tower itself is not part of the backbone."""

    model_type = "deepseek_v41_vision"
    base_config_key = "vision_config"

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None


_SUB_CONFIGS = {"text_config": DeepseekV41TextConfig, "vision_config": DeepseekV41VisionConfig}


class DeepseekV41Config(PreTrainedConfig):
    model_type = "deepseek_v41"
    # transformers >= 5.2x declares sub-configs as `sub_configs_defaults`, earlier 5.x as `sub_configs`
    if hasattr(PreTrainedConfig, "sub_configs_defaults"):
        sub_configs_defaults = dict(_SUB_CONFIGS)
    else:
        sub_configs = dict(_SUB_CONFIGS)

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    quantization_config: dict | None = None
    image_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list | None = 1
    pad_token_id: int | None = 2
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        for key, config_class in _SUB_CONFIGS.items():  # earlier transformers leave them as dicts
            value = getattr(self, key)
            if value is None or isinstance(value, dict):
                setattr(self, key, config_class(**(value or {})))
        super().__post_init__(**kwargs)
