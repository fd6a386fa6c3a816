"""Keep the model's rounding points through Inductor.

The model casts to bf16 where DeepSeek's reference rounds (hc_pre's output before the next RMSNorm
upcasts it, every sublayer's output, ...), and our pattern passes match those casts. Two Inductor
behaviours drop them:
  - fused intermediates stay in fp32 unless `emulate_precision_casts` is set;
  - in torch 2.11 (the H200's) the joint-graph pass `pointless_convert` deletes every single-use
    fp32 -> bf16 -> fp32 round trip before post-grad passes run. On the H200's torch 2.11 that left no mHC seam to match and
    moved the tiny model's compiled logits by up to 0.15 from eager (1e-6 with the round trips kept).
    torch 2.13 keeps a round trip through a narrower dtype; `keep_model_rounding` gives older versions the
    same rule by refusing those matches (a no-op where the rule is already there).
"""

from torch._inductor import config as inductor_config
from torch._inductor.fx_passes import joint_graph


def pointless_convert_entries() -> list:
    """Inductor's registered joint-graph entries of pointless_convert."""
    joint_graph.lazy_init()
    return [entry for entries in joint_graph.patterns.patterns.values() for entry in entries
            if getattr(entry, "handler", None) is joint_graph.pointless_convert]


def _not_narrowing(match) -> bool:
    """pointless_convert may run unless its intermediate dtype is narrower than its result (a rounding)."""
    return not match.kwargs["dtype1"].itemsize < match.kwargs["dtype2"].itemsize


def keep_model_rounding() -> None:
    """Make graphs compiled from now on round where the model rounds (process-wide, idempotent)."""
    inductor_config.emulate_precision_casts = True
    for entry in pointless_convert_entries():
        entry.extra_check = _not_narrowing
