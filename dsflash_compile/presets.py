"""Named configurations: the embedded defaults every command can run without a download.

  tiny          the golden fixture's shape (9 layers, hidden 256): CPU tests and the quick start
  flash-layer   one layer of each role at the released dims (7 layers, 8 experts): kernel / layer benchmarks
  flash-40l-e8  the released 40-layer schedule and dims with 8 routed experts (top-6) and 1M-row Engram
                tables: ~20B parameters, fits one H200
  release       the released DeepSeek-V4.1-Flash config.json, as shipped (load its weights with from_pretrained)

Random presets map tokens to Engram ids one to one (engram_compressed_vocab_size = vocab_size), since they
have no tokenizer; the release's map comes from its folder.
"""

from __future__ import annotations

import copy

import torch

from .configuration_deepseek_v41 import DeepseekV41Config
from .engram_hash import derive_hash_params

_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
          "expert_dtype": "fp4"}

_RELEASE_TEXT = {
    "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8,
    "o_lora_rank": 1024, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
    "max_position_embeddings": 1048576, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
    "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
}

_TINY_TEXT = {
    "vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 9,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64,
    "o_lora_rank": 64, "o_groups": 2, "swiglu_limit": 1.0, "rms_norm_eps": 1e-20, "max_position_embeddings": 256,
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 64},
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "routed_scaling_factor": 1.5,
    "sliding_window": 16, "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1], "kv_source_layer_ids": [2, 5],
    "index_source_layer_ids": [2, 5, 7], "index_n_heads": 8, "index_head_dim": 64, "index_topk": 8,
    "candidate_source_layer_id": 5, "candidate_topk_blocks": 4, "candidate_block_size": 4,
    "engram_layer_ids": [1, 2], "engram_max_ngram_size": 4, "engram_vocab_size": 1000, "engram_n_heads": 2,
    "engram_head_dim": 32, "engram_pad_token_id": 2, "num_nextn_predict_layers": 0,
}


def _random_engram(text: dict) -> dict:
    """One-to-one token map and the table rows the primes of engram_vocab_size give."""
    params = derive_hash_params(text["engram_layer_ids"], text["engram_max_ngram_size"], text["engram_n_heads"],
                                text["engram_vocab_size"], text["vocab_size"], 0)
    return dict(text, engram_compressed_vocab_size=text["vocab_size"], engram_num_embeddings=list(params.table_rows))


def _flash(layers: int, ratios: list, **overrides) -> dict:
    text = dict(_RELEASE_TEXT, num_hidden_layers=layers, compress_ratios=ratios, n_routed_experts=8,
                num_nextn_predict_layers=0, dspark_block_size=0, dspark_target_layer_ids=[],
                dspark_n_routed_experts=0, dspark_num_experts_per_tok=0, **overrides)
    return dict(text, engram_vocab_size=41667)  # 24 primes of ~41.7K: ~1M rows per table


def _text(name: str) -> dict:
    if name == "tiny":
        return dict(_TINY_TEXT)
    if name == "flash-40l-e8":
        return _flash(40, _RELEASE_TEXT["compress_ratios"][:40])
    if name == "flash-layer":
        # window; window + Engram; ratio-2 KV/index source + Engram; ratio-2 consumer;
        # ratio-1 candidate source; ratio-1 consumer; ratio-1 candidate index source
        return _flash(7, [0, 0, 2, 2, 1, 1, 1], kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 6],
                      candidate_source_layer_id=4, engram_layer_ids=[1, 2])
    if name == "release":
        return copy.deepcopy(_RELEASE_TEXT)
    raise KeyError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")


PRESETS = ("tiny", "flash-layer", "flash-40l-e8", "release")


def preset_config(name: str, **text_overrides) -> DeepseekV41Config:
    """The named configuration; keyword arguments override text-config fields (validated)."""
    text = dict(_text(name), **text_overrides)
    if name != "release":  # derived after the overrides, so they stay consistent with them
        text = _random_engram(text)
    return DeepseekV41Config(architectures=["DeepseekV41ForCausalLM"], text_config=text,
                             quantization_config=dict(_QUANT), image_token_id=text["vocab_size"] - 16,
                             dtype="bfloat16")


def preset_model(name: str, device: str | torch.device = "cpu", seed: int = 0, **text_overrides):
    """A random-weight DeepseekV41ForCausalLM of the named preset on `device`, in eval mode; one seed gives
    the same weights every time (benchmarks compare configurations on them)."""
    from .modeling_deepseek_v41 import DeepseekV41ForCausalLM  # the model module builds on this one's config

    torch.manual_seed(seed)
    with torch.device(device):
        return DeepseekV41ForCausalLM(preset_config(name, **text_overrides)).eval()
