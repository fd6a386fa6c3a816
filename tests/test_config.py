"""Config side: the released config.json, derived layer roles (MODEL.md section 1), schedule validation,
presets (BENCHMARKS.md "Configurations") and Auto registration. CPU only, no weights."""

import copy
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import dsflash_compile  # noqa: F401  (registers the Auto classes)
from dsflash_compile import (
    PRESETS,
    DeepseekV41Config,
    DeepseekV41ForCausalLM,
    DeepseekV41Model,
    DeepseekV41TextConfig,
    DeepseekV41VisionConfig,
    preset_config,
    register_auto_classes,
)
from dsflash_compile.configuration_deepseek_v41 import LayerRole, ScheduleError
from dsflash_compile.engram_hash import derive_hash_params

from golden import SHARED  # noqa: E402
RELEASE_CONFIG = SHARED / "configs" / "deepseek-v4.1-flash.config.json"
from golden import TINY_A as FIXTURE  # noqa: E402
GOLDEN_CONFIG = FIXTURE / "config.json"
GOLDEN_README = FIXTURE / "README.md"

needs_release_config = pytest.mark.skipif(
    not RELEASE_CONFIG.is_file(), reason=f"release config not found at {RELEASE_CONFIG} (expected ../shared)")
needs_fixture = pytest.mark.skipif(
    not (GOLDEN_CONFIG.is_file() and GOLDEN_README.is_file()),
    reason=f"golden fixture tiny-a not found at {FIXTURE} (expected ../shared)")


def _release_json() -> dict:
    return json.loads(RELEASE_CONFIG.read_text())


def _golden_json() -> dict:
    return json.loads(GOLDEN_CONFIG.read_text())


def _folder_with(tmp_path: Path, cfg: dict, name: str = "cfg") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# =====================================================================================================
# 1. The released config.json loads as is
# =====================================================================================================

def _check_release_loaded(config, raw: dict):
    assert isinstance(config, DeepseekV41Config)
    assert config.model_type == "deepseek_v41"
    text, vision = config.text_config, config.vision_config
    assert isinstance(text, DeepseekV41TextConfig)
    assert isinstance(vision, DeepseekV41VisionConfig)
    assert config.quantization_config == raw["quantization_config"]
    assert config.get_text_config() is text
    assert config.image_token_id == raw["image_token_id"]
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)
    for key, value in raw["text_config"].items():
        assert getattr(text, key) == value, key
    for key, value in raw["vision_config"].items():
        assert getattr(vision, key) == value, key


@needs_release_config
def test_release_config_loads_from_kwargs():
    raw = _release_json()
    config = DeepseekV41Config(**copy.deepcopy(raw))
    _check_release_loaded(config, raw)


@needs_release_config
def test_release_config_loads_through_autoconfig(tmp_path):
    raw = _release_json()
    folder = tmp_path / "release"
    folder.mkdir()
    shutil.copy(RELEASE_CONFIG, folder / "config.json")
    config = AutoConfig.from_pretrained(folder)
    _check_release_loaded(config, raw)


@needs_release_config
def test_release_config_save_load_round_trip(tmp_path):
    raw = _release_json()
    config = DeepseekV41Config(**copy.deepcopy(raw))
    out = tmp_path / "saved"
    config.save_pretrained(out)
    reloaded = AutoConfig.from_pretrained(out)
    assert isinstance(reloaded, DeepseekV41Config)
    assert isinstance(reloaded.text_config, DeepseekV41TextConfig)
    assert isinstance(reloaded.vision_config, DeepseekV41VisionConfig)
    assert reloaded.quantization_config == raw["quantization_config"]
    assert reloaded.get_text_config() is reloaded.text_config
    # every field of the text config (the release's keys and ours) survives the trip
    before, after = config.text_config.to_dict(), reloaded.text_config.to_dict()
    for key in set(before) | set(after) | set(raw["text_config"]):
        if key in ("transformers_version",):
            continue
        assert getattr(reloaded.text_config, key) == getattr(config.text_config, key), key
    for key, value in raw["text_config"].items():
        assert getattr(reloaded.text_config, key) == value, key
    for key, value in raw["vision_config"].items():
        assert getattr(reloaded.vision_config, key) == value, key
    assert reloaded.text_config.layer_roles == config.text_config.layer_roles


# =====================================================================================================
# 2. Derived layer roles
# =====================================================================================================

def _release_expected_roles() -> list[LayerRole]:
    """MODEL.md section 1, transcribed row by row (not derived with the code under test)."""
    roles = []
    for layer in range(40):
        engram = layer in (1, 14)
        if layer in (0, 1):  # window only
            roles.append(LayerRole(layer, 0, False, False, False, False, None, None, engram))
        elif 2 <= layer <= 19:  # ratio 2: sources 2, 8, 14; consumers read the latest source at or below
            source = max(s for s in (2, 8, 14) if s <= layer)
            is_source = layer == source
            roles.append(LayerRole(layer, 2, is_source, is_source, False, False, source, source, engram))
        else:  # ratio 1: 20 = KV + index + candidate source; 24/28/32/36 candidate index sources
            assert 20 <= layer <= 39
            topk = max(s for s in (20, 24, 28, 32, 36) if s <= layer)
            roles.append(LayerRole(
                layer, 1,
                is_kv_source=layer == 20,
                is_index_source=layer == topk,
                is_candidate_source=layer == 20,
                uses_candidates=layer in (24, 28, 32, 36),
                kv_layer=20,
                topk_layer=topk,
                has_engram=engram,
            ))
    return roles


@needs_release_config
def test_release_layer_roles_match_model_md():
    text = DeepseekV41Config(**_release_json()).text_config
    roles = text.layer_roles
    expected = _release_expected_roles()
    assert len(roles) == 40
    for got, want in zip(roles, expected):
        assert got == want, f"layer {want.layer}: {got} != {want}"
    # a few rows spelled out, in the table's words
    assert [r.layer for r in roles if r.is_kv_source] == [2, 8, 14, 20]
    assert [r.layer for r in roles if r.is_index_source] == [2, 8, 14, 20, 24, 28, 32, 36]
    assert [r.layer for r in roles if r.is_candidate_source] == [20]
    assert [r.layer for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert [r.layer for r in roles if r.has_engram] == [1, 14]
    assert [r.layer for r in roles if r.ratio == 0] == [0, 1]
    assert all(r.rope_kind == ("window" if r.ratio == 0 else "compressed") for r in roles)
    # "Layers after the last KV source (21-39) own no growing state"
    assert text.last_kv_source_layer == 20


def _golden_readme_roles() -> list[dict]:
    """Rows of the README's "Layer roles" table."""
    text = GOLDEN_README.read_text()
    section = text.split("### Layer roles", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or not cells[0].isdigit():
            continue
        layer, ratio, role, kv_from, topk_from, engram, rope = cells
        rows.append(dict(layer=int(layer), ratio=int(ratio), role=role,
                         kv_from=int(kv_from) if kv_from else None,
                         topk_from=int(topk_from) if topk_from else None,
                         engram=engram == "yes", rope=rope))
    return rows


@needs_fixture
def test_golden_tiny_layer_roles_match_readme():
    rows = _golden_readme_roles()
    config = AutoConfig.from_pretrained(FIXTURE)
    assert isinstance(config, DeepseekV41Config)
    roles = config.text_config.layer_roles
    assert len(rows) == len(roles) == 9
    for row, role in zip(rows, roles):
        where = f"layer {row['layer']}"
        assert role.layer == row["layer"], where
        assert role.ratio == row["ratio"], where
        assert role.kv_layer == row["kv_from"], where
        assert role.topk_layer == row["topk_from"], where
        assert role.has_engram == row["engram"], where
        assert role.rope_kind == ("window" if "no YaRN" in row["rope"] else "compressed"), where
        kind = row["role"].split()[0]
        want = {  # kind -> (kv source, index source, candidate source, uses candidates)
            "SWA_ONLY": (False, False, False, False),
            "KV_INDEX_SOURCE": (True, True, False, False),
            "CANDIDATE_SOURCE": (True, True, True, False),
            "CANDIDATE_INDEX_SOURCE": (False, True, False, True),
            "CONSUMER_RATIO2": (False, False, False, False),
            "CONSUMER_RATIO1": (False, False, False, False),
        }[kind]
        got = (role.is_kv_source, role.is_index_source, role.is_candidate_source, role.uses_candidates)
        assert got == want, f"{where} ({kind})"


# =====================================================================================================
# 3. Validation: every error names its field
# =====================================================================================================

_TINY = {  # the golden tiny-a schedule, written out so these tests need no shared files
    "vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 9,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
    "q_lora_rank": 64, "o_lora_rank": 64, "o_groups": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "sliding_window": 16, "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1], "kv_source_layer_ids": [2, 5],
    "index_source_layer_ids": [2, 5, 7], "index_n_heads": 8, "index_head_dim": 64, "index_topk": 8,
    "candidate_source_layer_id": 5, "candidate_topk_blocks": 4, "candidate_block_size": 4,
    "engram_layer_ids": [1, 2], "engram_num_embeddings": [6126, 6332], "engram_vocab_size": 1000,
    "engram_n_heads": 2, "engram_head_dim": 32, "num_nextn_predict_layers": 0,
}


def _text(**overrides) -> DeepseekV41TextConfig:
    return DeepseekV41TextConfig(**dict(copy.deepcopy(_TINY), **overrides))


def test_tiny_schedule_is_valid():
    text = _text()
    assert [r.kv_layer for r in text.layer_roles] == [None, None, 2, 2, 2, 5, 5, 5, 5]
    assert [r.topk_layer for r in text.layer_roles] == [None, None, 2, 2, 2, 5, 5, 7, 7]


_INVALID = [
    # (test id, field the error must name, overrides)
    ("ratios-too-few", "compress_ratios", dict(compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1])),
    ("ratios-too-many", "compress_ratios", dict(compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 1, 0])),
    ("ratios-ignore-nextn", "compress_ratios", dict(num_nextn_predict_layers=2)),  # needs 9 + 2 entries
    ("ratio-negative", "compress_ratios", dict(compress_ratios=[0, -1, 2, 2, 2, 1, 1, 1, 1])),
    ("ratio-not-int", "compress_ratios", dict(compress_ratios=[0, 0, 2.0, 2, 2, 1, 1, 1, 1])),
    # layer 1 has ratio 2 but the only ratio-2 KV source is layer 2 (above it)
    ("no-kv-source-at-or-below", "compress_ratios", dict(compress_ratios=[0, 2, 2, 2, 2, 1, 1, 1, 1])),
    # a ratio 4 appears, no KV source of ratio 4 anywhere
    ("no-kv-source-for-ratio", "compress_ratios", dict(compress_ratios=[0, 0, 2, 2, 4, 1, 1, 1, 1])),
    # no index source at all for ratio 1 (the rule "a KV source is an index source" catches it)
    ("no-index-source-for-ratio", "index_source_layer_ids", dict(index_source_layer_ids=[2])),
    ("kv-source-ratio-0", "kv_source_layer_ids",
     dict(kv_source_layer_ids=[1, 2, 5], index_source_layer_ids=[1, 2, 5, 7])),
    ("index-source-ratio-0", "index_source_layer_ids", dict(index_source_layer_ids=[0, 2, 5, 7])),
    ("kv-source-not-index-source", "index_source_layer_ids", dict(index_source_layer_ids=[2, 7])),
    ("candidate-not-kv-source", "candidate_source_layer_id", dict(candidate_source_layer_id=7)),
    ("candidate-neither", "candidate_source_layer_id", dict(candidate_source_layer_id=6)),
    ("candidate-window-layer", "candidate_source_layer_id", dict(candidate_source_layer_id=0)),
    ("candidates-smaller-than-topk", "candidate_topk_blocks", dict(candidate_topk_blocks=1)),  # 1 x 4 < 8
    ("candidate-block-too-small", "candidate_topk_blocks", dict(candidate_block_size=1)),  # 4 x 1 < 8
    ("heads-not-divisible", "o_groups", dict(o_groups=3)),
    ("kv-heads-2", "num_key_value_heads", dict(num_key_value_heads=2)),
    ("kv-heads-0", "num_key_value_heads", dict(num_key_value_heads=0)),
    ("rope-odd", "qk_rope_head_dim", dict(qk_rope_head_dim=15)),
    ("rope-zero", "qk_rope_head_dim", dict(qk_rope_head_dim=0)),
    ("rope-over-head-dim", "qk_rope_head_dim", dict(qk_rope_head_dim=66)),
    ("rope-over-index-head-dim", "qk_rope_head_dim", dict(index_head_dim=8)),
    ("experts-per-tok", "num_experts_per_tok", dict(num_experts_per_tok=9)),
    ("engram-rows-short", "engram_num_embeddings", dict(engram_num_embeddings=[6126])),
    ("engram-rows-long", "engram_num_embeddings", dict(engram_num_embeddings=[6126, 6332, 7000])),
    ("engram-layers-dropped", "engram_num_embeddings", dict(engram_layer_ids=[1])),
    ("engram-head-dim", "engram_head_dim", dict(engram_head_dim=48)),
    ("sliding-window", "sliding_window", dict(sliding_window=0)),
    ("kv-unsorted", "kv_source_layer_ids", dict(kv_source_layer_ids=[5, 2])),
    ("kv-duplicate", "kv_source_layer_ids", dict(kv_source_layer_ids=[2, 2, 5])),
    ("kv-out-of-range", "kv_source_layer_ids", dict(kv_source_layer_ids=[2, 5, 9])),
    ("kv-negative", "kv_source_layer_ids", dict(kv_source_layer_ids=[-1, 2, 5])),
    ("index-unsorted", "index_source_layer_ids", dict(index_source_layer_ids=[2, 7, 5])),
    ("index-out-of-range", "index_source_layer_ids", dict(index_source_layer_ids=[2, 5, 7, 12])),
    ("engram-unsorted", "engram_layer_ids", dict(engram_layer_ids=[2, 1])),
    ("engram-duplicate", "engram_layer_ids", dict(engram_layer_ids=[1, 1])),
    ("engram-out-of-range", "engram_layer_ids", dict(engram_layer_ids=[1, 9])),
    ("engram-negative", "engram_layer_ids", dict(engram_layer_ids=[-1, 1])),
    ("scoring-func", "scoring_func", dict(scoring_func="softmax")),
]


@pytest.mark.parametrize("field, overrides", [pytest.param(f, o, id=i) for i, f, o in _INVALID])
def test_schedule_error_names_field(field, overrides):
    with pytest.raises(ScheduleError, match=rf"DeepseekV41TextConfig\.{re.escape(field)}\b"):
        _text(**overrides)


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_validation_runs_for_the_composite_config():
    with pytest.raises(ScheduleError, match="o_groups"):
        DeepseekV41Config(text_config=dict(copy.deepcopy(_TINY), o_groups=3))


def test_validation_runs_on_load(tmp_path):
    raw = {"model_type": "deepseek_v41", "text_config": dict(copy.deepcopy(_TINY), num_key_value_heads=2)}
    with pytest.raises(ScheduleError, match="num_key_value_heads"):
        AutoConfig.from_pretrained(_folder_with(tmp_path, raw))


def test_candidate_source_optional():
    for value in (None, -1):
        text = _text(candidate_source_layer_id=value, candidate_topk_blocks=1)  # no candidates: no check
        assert not any(r.is_candidate_source or r.uses_candidates for r in text.layer_roles)


def test_model_rejects_engram_rows_inconsistent_with_engram_vocab_size():
    bad = preset_config("tiny")
    rows = list(bad.text_config.engram_num_embeddings)
    bad.text_config.engram_num_embeddings = [rows[0], rows[1] + 1]  # the config alone accepts it
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        DeepseekV41ForCausalLM(bad)


# =====================================================================================================
# 4. Presets
# =====================================================================================================

@pytest.mark.parametrize("name", PRESETS)
def test_preset_validates(name):
    config = preset_config(name)
    assert isinstance(config, DeepseekV41Config)
    text = config.text_config
    assert isinstance(text, DeepseekV41TextConfig)
    text.validate_schedule()
    assert len(text.layer_roles) == text.num_hidden_layers
    assert config.architectures == ["DeepseekV41ForCausalLM"]
    # and it survives a save/load
    assert DeepseekV41Config.from_dict(config.to_dict()).text_config.to_dict() == text.to_dict()


_STRUCTURE = (
    "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
    "max_position_embeddings", "rope_theta", "compress_rope_theta", "rope_scaling", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "sliding_window", "compress_ratios", "kv_source_layer_ids",
    "index_source_layer_ids", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer_id",
    "candidate_topk_blocks", "candidate_block_size", "hc_mult", "engram_layer_ids", "engram_num_embeddings",
    "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_pad_token_id",
    "num_nextn_predict_layers", "swiglu_limit", "routed_scaling_factor", "scoring_func",
)


@needs_fixture
def test_tiny_preset_has_the_golden_shape():
    golden = _golden_json()["text_config"]
    text = preset_config("tiny").text_config
    for key in _STRUCTURE:
        assert getattr(text, key) == golden[key], key
    assert text.layer_roles == DeepseekV41Config(**_golden_json()).text_config.layer_roles


def test_tiny_preset_is_small():
    text = preset_config("tiny").text_config
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size) == (9, 256, 512)
    # random presets map tokens one to one to Engram ids
    assert text.engram_compressed_vocab_size == text.vocab_size


@needs_release_config
def test_flash_40l_e8_preset():
    release = _release_json()["text_config"]
    text = preset_config("flash-40l-e8").text_config
    dims = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size", "sliding_window",
            "index_n_heads", "index_head_dim", "index_topk", "candidate_topk_blocks", "candidate_block_size",
            "hc_mult", "engram_n_heads", "engram_head_dim", "engram_max_ngram_size", "rope_theta",
            "compress_rope_theta", "rope_scaling", "max_position_embeddings", "swiglu_limit",
            "routed_scaling_factor", "scoring_func", "rms_norm_eps")
    for key in dims:
        assert getattr(text, key) == release[key], key
    # BENCHMARKS.md: hidden 5120, 64 heads x 512, q_lora 1280, o 8x1024, indexer 32x128 top-512,
    # candidates 2048x8, window 128, moe_inter 2304, Engram on layers 1 and 14
    assert (text.hidden_size, text.num_attention_heads, text.head_dim) == (5120, 64, 512)
    assert (text.q_lora_rank, text.o_groups, text.o_lora_rank) == (1280, 8, 1024)
    assert (text.index_n_heads, text.index_head_dim, text.index_topk) == (32, 128, 512)
    assert (text.candidate_topk_blocks, text.candidate_block_size) == (2048, 8)
    assert (text.sliding_window, text.moe_intermediate_size) == (128, 2304)
    # the 40-layer schedule
    assert text.num_hidden_layers == 40
    assert text.num_nextn_predict_layers == 0
    assert text.compress_ratios == release["compress_ratios"][:40]
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "engram_layer_ids"):
        assert getattr(text, key) == release[key], key
    assert text.layer_roles == DeepseekV41Config(**_release_json()).text_config.layer_roles
    # experts
    assert (text.n_routed_experts, text.num_experts_per_tok, text.n_shared_experts) == (8, 6, 1)
    # Engram tables of about 1M rows
    assert text.engram_layer_ids == [1, 14]
    assert len(text.engram_num_embeddings) == 2
    for rows in text.engram_num_embeddings:
        assert 900_000 <= rows <= 1_100_000, rows


def test_flash_40l_e8_is_about_20b_parameters():
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(preset_config("flash-40l-e8"))
    n = sum(p.numel() for p in model.parameters())
    assert 18e9 <= n <= 22e9, n


@needs_release_config
def test_flash_layer_preset_has_one_layer_of_each_role():
    release = _release_json()["text_config"]
    text = preset_config("flash-layer").text_config
    for key in ("hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups",
                "o_lora_rank", "moe_intermediate_size", "sliding_window", "index_n_heads", "index_head_dim",
                "index_topk", "candidate_topk_blocks", "candidate_block_size", "engram_head_dim", "engram_n_heads"):
        assert getattr(text, key) == release[key], key
    assert text.num_hidden_layers == 7
    roles = text.layer_roles
    R = LayerRole
    assert roles == [
        R(0, 0, False, False, False, False, None, None, False),  # window
        R(1, 0, False, False, False, False, None, None, True),  # window + Engram
        R(2, 2, True, True, False, False, 2, 2, True),  # ratio-2 KV/index source (+ Engram)
        R(3, 2, False, False, False, False, 2, 2, False),  # ratio-2 consumer
        R(4, 1, True, True, True, False, 4, 4, False),  # ratio-1 candidate source
        R(5, 1, False, False, False, False, 4, 4, False),  # ratio-1 consumer
        R(6, 1, False, True, False, True, 4, 6, False),  # ratio-1 candidate index source
    ]
    for rows in text.engram_num_embeddings:
        assert 900_000 <= rows <= 1_100_000, rows


@needs_release_config
def test_release_preset_equals_shipped_config():
    raw = _release_json()
    config = preset_config("release")
    text = config.text_config
    for key, value in raw["text_config"].items():
        assert getattr(text, key) == value, key
    # and the top level (vision_config: defaults equal the release's)
    for key, value in raw.items():
        if key in ("text_config", "vision_config", "dtype", "model_type"):
            continue
        assert getattr(config, key) == value, key
    for key, value in raw["vision_config"].items():
        assert getattr(config.vision_config, key) == value, key
    assert config.model_type == raw["model_type"]
    assert text.layer_roles == DeepseekV41Config(**raw).text_config.layer_roles


def test_preset_returns_a_fresh_copy():
    a = preset_config("release")
    a.text_config.compress_ratios[0] = 7
    a.text_config.rope_scaling["factor"] = 1
    b = preset_config("release").text_config
    assert b.compress_ratios[0] == 0
    assert b.rope_scaling["factor"] == 16


def test_unknown_preset_raises_key_error_naming_choices():
    with pytest.raises(KeyError) as info:
        preset_config("flash-41l")
    message = str(info.value)
    assert "flash-41l" in message
    for name in PRESETS:
        assert name in message


def test_preset_overrides_apply():
    text = preset_config("tiny", sliding_window=32, index_topk=16, num_experts_per_tok=3).text_config
    assert (text.sliding_window, text.index_topk, text.num_experts_per_tok) == (32, 16, 3)
    text = preset_config("flash-layer", n_routed_experts=16).text_config
    assert text.n_routed_experts == 16


@pytest.mark.parametrize("overrides", [
    pytest.param(dict(vocab_size=1024), id="vocab_size"),  # model forward: "Engram needs a token map"
    pytest.param(dict(engram_vocab_size=2000), id="engram_vocab_size"),  # model build: ValueError
    pytest.param(dict(engram_n_heads=4), id="engram_n_heads"),  # model build: ValueError
    pytest.param(dict(engram_layer_ids=[1]), id="engram_layer_ids"),  # config: ScheduleError
])
def test_preset_overrides_keep_derived_engram_fields_consistent(overrides):
    text = preset_config("tiny", **overrides).text_config
    # the preset's documented invariant: random presets map tokens to Engram ids one to one
    assert text.engram_compressed_vocab_size == text.vocab_size
    rows = derive_hash_params(text.engram_layer_ids, text.engram_max_ngram_size, text.engram_n_heads,
                              text.engram_vocab_size, text.engram_compressed_vocab_size, 0).table_rows
    assert list(text.engram_num_embeddings) == list(rows)


@pytest.mark.parametrize("overrides, field", [
    (dict(o_groups=3), "o_groups"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(index_topk=17), "candidate_topk_blocks"),  # 4 blocks x 4 < 17
    (dict(kv_source_layer_ids=[3, 5], index_source_layer_ids=[3, 5, 7]),
     "compress_ratios"),  # layer 2 (ratio 2) has no KV source at or below it
    (dict(scoring_func="sigmoid"), "scoring_func"),
])
def test_preset_overrides_are_validated(overrides, field):
    with pytest.raises(ScheduleError, match=field):
        preset_config("tiny", **overrides)


# =====================================================================================================
# 5. Registration with the Auto classes
# =====================================================================================================

def test_auto_config_maps_model_types():
    assert CONFIG_MAPPING["deepseek_v41"] is DeepseekV41Config
    assert CONFIG_MAPPING["deepseek_v41_text"] is DeepseekV41TextConfig
    assert CONFIG_MAPPING["deepseek_v41_vision"] is DeepseekV41VisionConfig
    assert isinstance(AutoConfig.for_model("deepseek_v41"), DeepseekV41Config)


def test_auto_model_builds_ours():
    config = preset_config("tiny")
    model = AutoModelForCausalLM.from_config(config)
    assert type(model) is DeepseekV41ForCausalLM
    # the base model: checked on the mapping (a second random init would only cost time)
    assert AutoModel._model_mapping[DeepseekV41Config] is DeepseekV41Model
    assert AutoModelForCausalLM._model_mapping[DeepseekV41Config] is DeepseekV41ForCausalLM


def test_register_again_is_harmless(caplog):
    with caplog.at_level(logging.WARNING):
        register_auto_classes()
        register_auto_classes()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "deepseek_v41" in r.getMessage()]
    assert CONFIG_MAPPING["deepseek_v41"] is DeepseekV41Config
    assert AutoModelForCausalLM._model_mapping[DeepseekV41Config] is DeepseekV41ForCausalLM
    assert AutoModel._model_mapping[DeepseekV41Config] is DeepseekV41Model


def test_register_replaces_an_existing_deepseek_v41(caplog, tmp_path):
    class OtherDeepseekV41Config(PreTrainedConfig):
        model_type = "deepseek_v41"

    try:
        AutoConfig.register("deepseek_v41", OtherDeepseekV41Config, exist_ok=True)
        assert CONFIG_MAPPING["deepseek_v41"] is OtherDeepseekV41Config
        with caplog.at_level(logging.WARNING, logger="dsflash_compile"):
            register_auto_classes()
        assert CONFIG_MAPPING["deepseek_v41"] is DeepseekV41Config
        assert isinstance(AutoConfig.for_model("deepseek_v41"), DeepseekV41Config)
        folder = _folder_with(tmp_path, {"model_type": "deepseek_v41", "text_config": copy.deepcopy(_TINY)})
        assert type(AutoConfig.from_pretrained(folder)) is DeepseekV41Config
        assert type(AutoModelForCausalLM.from_config(preset_config("tiny"))) is DeepseekV41ForCausalLM
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "deepseek_v41" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        assert "OtherDeepseekV41Config" in warnings[0].getMessage()
        assert warnings[0].name.startswith("dsflash_compile")
    finally:
        register_auto_classes()
    assert CONFIG_MAPPING["deepseek_v41"] is DeepseekV41Config
