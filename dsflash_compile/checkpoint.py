"""Reading and writing the released checkpoint layout of DeepSeek-V4.1-Flash.

Names are the official ones (no `model.` prefix): `embed.weight`, `layers.L.attn.*`, `layers.L.ffn.*`,
`norm.weight`, `head.weight`, ... Storage (shared/golden/tiny-a/README.md, "Checkpoint naming and formats"):
  - FP8 32x32 blocks: attn.{wq_a,wq_b,wkv,wo_a,wo_b}, attn.indexer.wq_b, ffn.shared_experts.w{1,2,3}, engram.wkv
  - MXFP4: ffn.experts.E.w{1,2,3}
  - FP8 per-row groups of 32: engram.embed
  - everything else as is: BF16 or F32 (`official_dtype`).
A quantized weight is `X.weight` + `X.scale`; the model holds it as one bf16 tensor `X.weight`.

Conversions `load_into` accepts from the stored (dequantized) dtype to the target dtype:
  - the same dtype, or an always-exact widening (bf16/f16 -> f32/f64, f32 -> f64): e.g. `hc_*_fn` stored as
    BF16 (one third-party writer does) into the reference's fp32 parameter, or dequantized weights into f32;
  - F32 -> BF16 only if every value is exactly a bf16 (checked after reading): `inference/convert.py`
    widens head and compressor to F32;
  - nothing else: e.g. F16 where BF16 is expected (different exponent range: never exact in general),
    or a float8/int8 weight without its `.scale`.
A quantized-format weight stored as a float without `.scale` (convert.py writes `attn.wo_a` as bf16) is
taken as already dequantized.
"""

import json
import logging
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import formats

log = logging.getLogger(__name__)

FP8_BLOCK, MXFP4, FP8_ROWS = "fp8_block", "mxfp4", "fp8_rows"

# module name (without .weight/.scale) -> format; `(?:^|\.)` keeps attn.wkv apart from attn.compressor.wkv
_FORMATS = (
    (FP8_BLOCK, re.compile(r"(?:^|\.)(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|engram\.wkv)$")),
    (MXFP4, re.compile(r"(?:^|\.)ffn\.experts\.\d+\.w[123]$")),
    (FP8_ROWS, re.compile(r"(?:^|\.)engram\.embed$")),
)
_STORAGE = {FP8_BLOCK: torch.float8_e4m3fn, MXFP4: torch.int8, FP8_ROWS: torch.float8_e4m3fn}
_ROWS_PER_SCALE = {FP8_BLOCK: formats.BLOCK, MXFP4: 1, FP8_ROWS: 1}
_DEQUANT = {FP8_BLOCK: formats.dequant_fp8_block, MXFP4: formats.dequant_mxfp4, FP8_ROWS: formats.dequant_fp8_rows}
_QUANT = {FP8_BLOCK: formats.quant_fp8_block, MXFP4: formats.quant_mxfp4, FP8_ROWS: formats.quant_fp8_rows}

_F32 = re.compile(r"(?:^|\.)(?:attn\.attn_sink|ffn\.gate\.bias|ffn\.gate\.bias_vl|hc_[a-z]+_(?:fn|base|scale))$")
_BF16 = re.compile(
    r"(?:^|\.)(?:(?:embed|head)\.weight|\w*norm\.weight|ffn\.gate\.weight|attn\.compressor\.(?:wkv|wgate)\.weight"
    r"|attn\.indexer\.(?:wk|weights_proj)\.weight|engram\.(?:q_weight|k_weight))$"
)

# Draft layers (DSpark / MTP) and the vision tower are not part of the backbone (MODEL.md section 8).
SKIP_PREFIXES = ("mtp.", "vision.", "visual.", "vision_model.", "dspark.")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
_EXACT_WIDENING = {
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float64),
    (torch.float16, torch.float32), (torch.float16, torch.float64), (torch.float32, torch.float64),
}
_READ_ELEMS = 1 << 24  # rows of a quantized weight are read and dequantized ~16M elements at a time


class CheckpointError(ValueError):
    """A checkpoint does not match what is expected; the message names the tensor(s)."""


def weight_format(name: str) -> str | None:
    """FP8_BLOCK / MXFP4 / FP8_ROWS for a quantized `X.weight` or `X.scale` name, None otherwise."""
    module, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "scale"):
        return None
    for fmt, pattern in _FORMATS:
        if pattern.search(module):
            return fmt
    return None


def official_dtype(name: str) -> torch.dtype:
    """Storage dtype of a tensor in the release.

    Quantized names: float8_e4m3fn / int8 for `.weight`, float8_e8m0fnu for `.scale`. Others: bfloat16 (embed,
    head, norms, router weight, compressor, indexer wk / weights_proj, engram q_weight / k_weight) or
    float32 (attn_sink, router bias and bias_vl, hc_*). Unknown names raise CheckpointError.
    """
    fmt = weight_format(name)
    if fmt is not None:
        return torch.float8_e8m0fnu if name.endswith(".scale") else _STORAGE[fmt]
    if _F32.search(name):
        return torch.float32
    if _BF16.search(name):
        return torch.bfloat16
    raise CheckpointError(f"{name}: not in the release's format table (no official storage dtype)")


def scale_shape(fmt: str, shape) -> tuple:
    """UE8M0 scale shape of a quantized weight of logical (dequantized) shape [rows, cols] in format `fmt`."""
    rows, cols = shape
    return (math.ceil(rows / _ROWS_PER_SCALE[fmt]), math.ceil(cols / formats.BLOCK))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the reader yields it: `shape`/`dtype` after dequantization (bf16 for quantized ones)."""

    name: str
    shape: tuple
    dtype: torch.dtype
    stored: str  # safetensors dtype of the stored `.weight` (or the tensor itself)
    fmt: str | None  # None: stored as is
    file: Path
    scale_file: Path | None = None


class CheckpointReader:
    """Lazy, shard-by-shard reader of a released checkpoint folder.

    Finds `model.safetensors.index.json` (+ its shards) or `model.safetensors` (or index-less shards),
    validates every header up front, and yields (official name, tensor) one tensor at a time: a quantized
    `X.weight` + `X.scale` pair (possibly in different shards) comes out as one bf16 `X.weight`, read and
    dequantized in chunks of rows. Tensors under SKIP_PREFIXES are skipped (one log line counts them).
    """

    def __init__(self, folder, raw_formats: tuple = ()):
        """raw_formats: quantized formats kept as stored (X.weight and X.scale as two plain entries), for
        models that hold those weights in their release format (the Engram table: FP8_ROWS)."""
        self.folder = Path(folder)
        self.files, stored = self._read_headers()  # stored: key -> (file, safetensors dtype, shape)
        self.skipped = Counter(p for k in stored for p in SKIP_PREFIXES if k.startswith(p))
        stored = {k: v for k, v in stored.items() if not k.startswith(SKIP_PREFIXES)}
        self.entries: dict[str, TensorInfo] = {}
        problems = []
        for key, (file, dt, shape) in stored.items():
            base, _, leaf = key.rpartition(".")
            scale = stored.get(base + ".scale") if leaf == "weight" else None
            fmt = weight_format(key)
            if fmt in raw_formats:
                self.entries[key] = TensorInfo(key, shape, _ST_DTYPES.get(dt), dt, None, file)
                continue
            if leaf == "scale" and fmt is not None and base + ".weight" in stored:
                continue  # read together with its weight
            if leaf == "scale" and (fmt is not None or dt == "F8_E8M0"):
                problems.append(f"{key}: scale without {base}.weight" if fmt else f"{key}: scale of a tensor that is not quantized in the release")
            elif scale is None and dt in ("F8_E4M3", "I8", "U8") and leaf == "weight":
                problems.append(f"{key}: wrong dtype: {dt} weight without {base}.scale (cannot be dequantized)")
            elif scale is None:
                self.entries[key] = TensorInfo(key, shape, _ST_DTYPES.get(dt), dt, None, file)
                if dt not in _ST_DTYPES:
                    problems.append(f"{key}: unsupported storage dtype {dt}")
            else:
                problems += self._add_quantized(key, fmt, file, dt, shape, scale)
        if problems:
            raise CheckpointError(f"{self.folder}:\n  " + "\n  ".join(problems))
        if self.skipped:
            counts = ", ".join(f"{p}*: {n}" for p, n in sorted(self.skipped.items()))
            log.info("%s: skipped %d tensors outside the backbone (%s)", self.folder, sum(self.skipped.values()), counts)

    def _read_headers(self):
        """(shard files in order, {key: (file, safetensors dtype, shape)}) from the headers alone."""
        index, single = self.folder / INDEX_FILE, self.folder / SINGLE_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({self.folder / f for f in weight_map.values()})
        elif single.exists():
            weight_map, files = None, [single]
        else:
            files = sorted(p for p in self.folder.glob("model-*-of-*.safetensors") if _SHARD.fullmatch(p.name))
            weight_map = None
            if not files:
                raise CheckpointError(f"{self.folder}: no {SINGLE_FILE}, {INDEX_FILE} or model-<i>-of-<n>.safetensors")
        stored = {}
        for file in files:
            if not file.exists():
                raise CheckpointError(f"{self.folder}: {INDEX_FILE} names a missing file {file.name}")
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    if weight_map is None or weight_map.get(key) == file.name:
                        sl = f.get_slice(key)
                        stored[key] = (file, sl.get_dtype(), tuple(sl.get_shape()))
        if weight_map is not None:
            lost = [k for k, f in weight_map.items() if k not in stored]
            if lost:
                raise CheckpointError(f"{self.folder}: tensors listed in {INDEX_FILE} but not in their shard: {', '.join(lost)}")
        return files, stored

    def _add_quantized(self, key, fmt, file, dt, shape, scale) -> list:
        scale_file, scale_dt, found = scale
        expected = {FP8_BLOCK: ("F8_E4M3",), FP8_ROWS: ("F8_E4M3",), MXFP4: ("I8", "U8")}.get(fmt)
        if fmt is None:
            return [f"{key}: has a .scale but is not a quantized tensor of the release"]
        if dt not in expected or len(shape) != 2:
            return [f"{key}: wrong dtype/shape for {fmt}: expected a 2-D {' or '.join(expected)} tensor, found {dt} {list(shape)}"]
        if scale_dt != "F8_E8M0":
            return [f"{key[:-7]}.scale: wrong dtype: expected F8_E8M0, found {scale_dt}"]
        logical = (shape[0], 2 * shape[1]) if fmt == MXFP4 else shape
        if found != scale_shape(fmt, logical):
            return [f"{key[:-7]}.scale: wrong shape: expected {list(scale_shape(fmt, logical))} for {fmt} weight {list(shape)}, found {list(found)}"]
        self.entries[key] = TensorInfo(key, logical, torch.bfloat16, dt, fmt, file, scale_file)
        return []

    def __len__(self) -> int:
        return len(self.entries)

    def names(self) -> list[str]:
        return list(self.entries)

    def __iter__(self):
        return self.items()

    def items(self, device="cpu", keep_scales: bool = False):
        """Yield (name, tensor) shard by shard, on `device`. keep_scales: also yield each raw `X.scale`
        (float8_e8m0fnu) right after its dequantized `X.weight`, so that save_checkpoint can reuse it."""
        by_file = {f: [] for f in self.files}
        for info in self.entries.values():
            by_file[info.file].append(info)
        for file, infos in by_file.items():
            with safe_open(file, "pt") as f:
                for info in infos:
                    if info.fmt is None:
                        yield info.name, f.get_tensor(info.name).to(device)
                    elif info.scale_file == file:
                        yield from self._quantized(info, f, f, device, keep_scales)
                    else:
                        with safe_open(info.scale_file, "pt") as g:
                            yield from self._quantized(info, f, g, device, keep_scales)

    @staticmethod
    def _quantized(info: TensorInfo, f, g, device, keep_scales: bool):
        base = info.name[: -len(".weight")]
        w, s = f.get_slice(info.name), g.get_slice(base + ".scale")
        rows, cols = info.shape
        per = _ROWS_PER_SCALE[info.fmt]
        out = torch.empty(info.shape, dtype=torch.bfloat16, device=device)
        step = max(per, (_READ_ELEMS // cols) // per * per)  # whole scale rows per chunk
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            out[r0:r1] = _DEQUANT[info.fmt](w[r0:r1].to(device), s[r0 // per : math.ceil(r1 / per)].to(device))
        yield info.name, out
        if keep_scales:
            yield base + ".scale", s[:].to(device)


def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src, dst) in _EXACT_WIDENING or (src, dst) == (torch.float32, torch.bfloat16)


def _same_bytes(name: str, src: torch.dtype, dst: torch.dtype) -> bool:
    """Packed E2M1 bytes stored as U8 for a model that holds them as the release's I8: the same codes."""
    return weight_format(name) == MXFP4 and name.endswith(".weight") and (src, dst) == (torch.uint8, torch.int8)


def _exact_cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = t.to(dtype)
    back = out.to(t.dtype)
    if not bool(((back == t) | (back.isnan() & t.isnan())).all()):
        raise CheckpointError(f"{name}: wrong dtype: stored {t.dtype} values are not exactly representable in {dtype}")
    return out


def load_into(module_state: dict, folder, *, device, dtype_overrides: dict | None = None, owned=None) -> dict:
    """Read `folder` for the target tensors `module_state` (official name -> tensor, meta is fine).
    owned: a predicate on official names; the checkpoint's other tensors (another rank's experts) are
    neither read nor unexpected.

    Returns {name: tensor on `device` in the target dtype (dtype_overrides[name] if given)}. All header
    problems are reported together before anything is read: missing and unexpected tensors (all listed),
    wrong shapes (expected vs found) and dtypes that cannot be converted exactly (see module docstring).
    """
    # a target that holds a quantized weight in its stored dtype (float8, not bf16) is read raw
    raw = tuple({weight_format(n) for n, t in module_state.items()
                 if weight_format(n) and t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu)})
    reader = CheckpointReader(folder, raw_formats=raw)
    if owned is not None:
        reader.entries = {n: info for n, info in reader.entries.items() if owned(n)}
    overrides = dict(dtype_overrides or {})
    target = {n: (tuple(t.shape), overrides.pop(n, t.dtype)) for n, t in module_state.items()}
    problems = []
    if overrides:
        problems.append(f"dtype_overrides for unknown tensors: {', '.join(sorted(overrides))}")
    # projections the model holds encoded (weights="native") but the checkpoint stores dequantized, without a
    # scale (convert.py's wo_a): one problem each, named below, rather than a missing scale and a wrong dtype
    dequantized = {n for n, info in reader.entries.items() if weight_format(n) in raw and weight_format(n) != FP8_ROWS
                   and n.endswith(".weight") and info.stored in ("BF16", "F16", "F32")}
    missing = [n for n in target if n not in reader.entries and n[: -len(".scale")] + ".weight" not in dequantized]
    unexpected = [n for n in reader.entries if n not in target]
    if missing:
        problems.append(f"missing {len(missing)} tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensors: {', '.join(unexpected)}")
    for name, (shape, dtype) in target.items():
        info = reader.entries.get(name)
        if info is None:
            continue
        if name in dequantized:
            problems.append(f"{name}: stored dequantized ({info.stored}, as convert.py writes attn.wo_a), but the "
                            f"model holds it in its release format (weights='native'); load with weights='bf16'")
        elif info.shape != shape:
            problems.append(f"{name}: wrong shape: expected {list(shape)}, found {list(info.shape)}")
        elif not (_convertible(info.dtype, dtype) or _same_bytes(name, info.dtype, dtype)):
            what = f"{info.stored} (dequantized to {info.dtype})" if info.fmt else info.stored
            problems.append(f"{name}: wrong dtype: {what} in the checkpoint cannot be converted exactly to {dtype}")
    if problems:
        raise CheckpointError(f"{reader.folder}:\n  " + "\n  ".join(problems))
    loaded = {}
    for name, t in reader.items(device):
        dtype = target[name][1]
        if _same_bytes(name, t.dtype, dtype):
            t = t.view(dtype)
        elif t.dtype != dtype:
            t = t.to(dtype) if (t.dtype, dtype) in _EXACT_WIDENING else _exact_cast(name, t, dtype)
        loaded[name] = t
    return loaded


def _encoded_nbytes(name: str, t: torch.Tensor) -> int:
    """Bytes `name` will take on disk (weight + scale for quantized ones); checks what can be encoded."""
    fmt = weight_format(name)
    if fmt is None:
        return t.numel() * official_dtype(name).itemsize
    if t.dtype == _STORAGE[fmt]:  # already encoded (kept in its release format): written as is
        logical = (t.shape[0], 2 * t.shape[1]) if fmt == MXFP4 else t.shape  # packed E2M1: two inputs a byte
        return t.numel() * t.element_size() + math.prod(scale_shape(fmt, logical))
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) or t.dim() != 2:
        raise CheckpointError(f"{name}: expected a 2-D dequantized float weight to quantize as {fmt}, got {t.dtype} {list(t.shape)}")
    rows, cols = t.shape
    scales = math.prod(scale_shape(fmt, t.shape))
    return (rows * cols // 2 if fmt == MXFP4 else rows * cols) + scales


def _encode(name: str, t: torch.Tensor, scale: torch.Tensor | None) -> dict:
    """name -> stored tensors on CPU: re-quantized weight + scale, or the tensor in its official dtype."""
    fmt = weight_format(name)
    t = t.detach()
    if fmt is None:
        # copy: safetensors refuses tensors that share storage (tied or sliced parameters)
        stored = official_dtype(name)
        if (t.dtype, stored) not in _EXACT_WIDENING and t.dtype != stored:
            t = _exact_cast(name, t, stored)  # narrowing (e.g. the fp32 compressor to bf16) must lose nothing
        return {name: t.to("cpu", stored, copy=True).contiguous()}
    if t.dtype == _STORAGE[fmt]:
        if scale is None:
            raise CheckpointError(f"{name}: an encoded {fmt} weight needs its {name[:-7]}.scale")
        return {name: t.cpu().contiguous(), name[: -len(".weight")] + ".scale": scale.cpu().contiguous()}
    try:
        w, s = _QUANT[fmt](t, scale=None if scale is None else scale.to(t.device))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{name}: {e}") from e
    return {name: w.cpu(), name[: -len(".weight")] + ".scale": s.cpu()}


def save_checkpoint(named_tensors: dict, folder, *, max_shard_bytes: int | None = None) -> None:
    """Write official name -> tensor in the release layout: `model.safetensors`, or, when max_shard_bytes
    is set and the tensors do not fit in one, `model-<i>-of-<n>.safetensors` + `model.safetensors.index.json`.

    Quantized weights (given dequantized, any float dtype) are re-quantized with the smallest non-clipping
    power-of-two scales; an `X.scale` (float8_e8m0fnu) next to `X.weight` pins the scale instead (needed for
    byte-identical round trips, see formats.py). Other tensors are cast to official_dtype(name).
    A weight and its scale always share a shard. Existing model*.safetensors / index files in `folder`
    are removed first so that no stale shard or index can be picked up by a reader.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    units = []  # (weight or plain name, encoded bytes), in input order
    for name, t in named_tensors.items():
        base, _, leaf = name.rpartition(".")
        if leaf == "scale" and weight_format(name) is not None:
            if base + ".weight" not in named_tensors:
                raise CheckpointError(f"{name}: scale given without {base}.weight")
            continue
        units.append((name, _encoded_nbytes(name, t)))

    shards, size = [[]], 0
    for name, nbytes in units:
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes

    for p in folder.iterdir():
        if p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD.fullmatch(p.name):
            p.unlink()
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in shard:
            pinned = named_tensors.get(name.rpartition(".")[0] + ".scale") if weight_format(name) else None
            tensors.update(_encode(name, named_tensors[name], pinned))
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
