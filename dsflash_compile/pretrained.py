"""`from_pretrained` / `save_pretrained` for the released checkpoint layout (no hub downloads).

The model is built on the meta device (no memory, no random init), then every tensor is read once from
the folder, shard by shard, and assigned in place. Where the release stores FP8/MXFP4, `weights="native"`
(the default on CUDA) keeps the stored bytes and scales; `weights="bf16"` (the default elsewhere)
dequantizes them exactly to bf16.
Names: the checkpoint's official names are the model's parameter names without the `model.` prefix.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.utils.hub import convert_file_size_to_int

from . import checkpoint, engram_hash

log = logging.getLogger(__name__)


def to_official(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def to_module(name: str) -> str:
    return name if name.startswith("head.") else "model." + name


def resolve_device(device_map) -> torch.device:
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) != 1:
            raise ValueError(f"device_map splits the model over {sorted(map(str, devices))}; only one device is "
                             "supported here (multi-GPU is tensor/expert parallel, a separate feature)")
        device_map = devices.pop()
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device_map)


def load_pretrained(cls, folder, config=None, device_map=None, dtype=None, engram_token_map=None, parallel=None,
                    **overrides):
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder; dsflash_compile loads local checkpoints only "
                                "(config.json + model*.safetensors)")
    if dtype not in (None, "auto", torch.bfloat16, "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: the model's dtypes are the release's (bf16 activations, fp32 where the "
                         "reference computes in fp32); pass dtype=None or torch.bfloat16")
    if config is None:
        config = cls.config_class.from_pretrained(folder)
    text = config.get_text_config()
    for key, value in overrides.items():
        if not hasattr(text, key):
            raise TypeError(f"from_pretrained got an unexpected argument {key!r} (not a DeepseekV41TextConfig field)")
        setattr(text, key, value)
    device = resolve_device(device_map)
    if text.weights is None:
        text.weights = "native" if device.type == "cuda" else "bf16"
    text.validate_schedule()

    with torch.device("meta"):
        model = cls(config)
    owned = None
    if parallel is not None:  # this rank reads its own routed experts only
        from .parallel import owned_by

        owned = owned_by(text, *parallel)
    targets = {to_official(n): t for n, t in model.state_dict().items()}
    targets = {n: t for n, t in targets.items() if owned is None or owned(n)}
    loaded = checkpoint.load_into(targets, folder, device=device, owned=owned)
    # safetensors hands tensors back at their file offsets; MKL's small GEMMs round differently on
    # unaligned operands, so give every CPU tensor fresh (64-byte aligned) storage: same bits every load.
    for name, t in loaded.items():  # one at a time: the unaligned original is freed as it is replaced
        if t.device.type == "cpu" and t.data_ptr() % 64:
            loaded[name] = t.clone()
    model.load_state_dict({to_module(n): t for n, t in loaded.items()}, assign=True, strict=owned is None)
    del loaded  # the experts' loaded tensors are freed as the stacks below replace them
    if parallel is not None:
        from .parallel import parallelize

        parallelize(model, *parallel)  # drops the other experts (still on meta), slices, restacks what it shards
    for layer in model.model.layers:  # assign replaced the stacked views with the loaded tensors
        if layer.ffn.stacks_stale():
            layer.ffn.stack_experts(layer.ffn.shared_stacked)
    model.model.rebuild_buffers(device)
    if text.engram_layer_ids:
        # explicit map > the folder's map file or tokenizer > identity (only valid when sizes agree)
        identity_ok = text.engram_compressed_vocab_size == text.vocab_size
        if engram_token_map is None and not (identity_ok and not _has_token_map(folder)):
            engram_token_map = engram_hash.load_token_map(folder)
        if engram_token_map is not None:
            model.model.set_engram_token_map(engram_token_map)
    model.name_or_path = str(folder)
    return model.eval()


def _has_token_map(folder: Path) -> bool:
    return (folder / engram_hash.TOKEN_MAP_FILE).exists() or (folder / engram_hash.TOKENIZER_FILE).exists()


def save_pretrained(model, folder, max_shard_size=None) -> None:
    """config.json + the release layout (quantized weights re-encoded exactly; see checkpoint.py) + the
    Engram token map when the model has one that is not the identity."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)
    tensors = {to_official(n): t for n, t in model.state_dict().items()}
    max_bytes = None if max_shard_size is None else convert_file_size_to_int(max_shard_size)
    checkpoint.save_checkpoint(tensors, folder, max_shard_bytes=max_bytes)
    inner = model.model
    if inner.engram_params is not None and not inner.engram_token_map_is_identity:
        save_file({"token_map": inner.engram_token_map.cpu().contiguous()}, str(folder / engram_hash.TOKEN_MAP_FILE))
