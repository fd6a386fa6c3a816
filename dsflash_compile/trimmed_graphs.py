"""CUDA graphs of bounded replay's trimmed layers (SYSTEM.md, bounded replay).

With bounded replay the last prompt chunk runs the layers after the last KV source on only the last
`sliding_window` columns of each row: [B, 128] at the release, whatever the prompt length. Those ~20
compiled blocks are short and launch-bound, so, like the decode step, they are captured as one CUDA graph
per batch bucket (the equivalent of compiling them with mode="reduce-overhead", with one replay for the
whole region instead of one per block), while the layers up to the cut run as the ordinary prefill chunk.

A graph is keyed by the layout of every argument (each context field, the streams (a PendingPost from the last
KV source's block), pre-mix and any Engram ids: tensor shapes and dtypes, dict keys, what is None), all derived
from the context's fields, so a new field or a different input set captures a new graph instead of being
copied into the wrong buffers. The first call
for a key runs the blocks directly on a side stream, on a copy of its inputs made as the static one is (that
compiles them for such copies and does every lazy initialisation, as capture requires) and then captures;
capture records kernels without running them, so the cache is not written twice.
"""

from __future__ import annotations

import dataclasses

import torch

from .context import ForwardContext
from .mhc import PendingPost


def _arguments(ctx: ForwardContext, streams, pre_mix, hash_ids: dict) -> list:
    """The trimmed part's arguments as (name, value) pairs: every field of the context, then the rest."""
    fields = [(f.name, getattr(ctx, f.name)) for f in dataclasses.fields(ctx)]
    return fields + [("streams", streams), ("pre_mix", pre_mix), ("hash_ids", hash_ids)]


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in a value (dicts by key, a PendingPost's fields in order), in a fixed order: what a replay
    copies into the graph."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in _tensors(value[key])]
    if isinstance(value, PendingPost):
        return [t for item in value for t in _tensors(item)]
    return []


def _layout(value):
    """What a captured graph is specific to: tensor shapes and dtypes, dict keys, None and host values."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, dict):
        return tuple((key, _layout(value[key])) for key in sorted(value))
    if isinstance(value, PendingPost):
        return "PendingPost", tuple(_layout(item) for item in value)
    return value if value is None or isinstance(value, (int, float, bool)) else id(value)  # the cache: by identity


def _clone(value):
    """Fixed-address copies of a value's tensors (the cache and host values stay as they are). A copy is an
    inference tensor only if the original is: the compiled blocks' guards check dispatch keys, and a model
    buffer (the RoPE frequencies) copied under inference mode made the H200 recompile every trimmed block."""
    if isinstance(value, torch.Tensor):
        with torch.inference_mode(value.is_inference()):
            return value.clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    if isinstance(value, PendingPost):
        return PendingPost(*(_clone(item) for item in value))
    return value


def _inputs(ctx: ForwardContext, streams, pre_mix, hash_ids: dict) -> list[torch.Tensor]:
    return [t for _, value in _arguments(ctx, streams, pre_mix, hash_ids) for t in _tensors(value)]


def _signature(ctx: ForwardContext, streams, pre_mix, hash_ids: dict) -> tuple:
    return tuple((name, _layout(value)) for name, value in _arguments(ctx, streams, pre_mix, hash_ids))


def _static_copy(ctx: ForwardContext, streams, pre_mix, hash_ids: dict):
    """Clones of the inputs at fixed addresses (the graph reads these; each call copies into them)."""
    fields = {f.name: _clone(getattr(ctx, f.name)) for f in dataclasses.fields(ctx)}
    return dataclasses.replace(ctx, **fields), _clone(streams), _clone(pre_mix), _clone(hash_ids)


class TrimmedGraphs:
    """Callable with `DeepseekV41Model.run_trimmed`'s arguments: replays the captured graph for these
    input shapes (capturing it after a first direct run). `graphs` maps signature -> graph entry."""

    def __init__(self, model, pool=None):
        self.model, self.pool = model, pool
        self.graphs: dict[tuple, tuple] = {}

    def __call__(self, ctx: ForwardContext, cache, streams: torch.Tensor, pre_mix: torch.Tensor,
                 hash_ids: dict) -> torch.Tensor:
        key = _signature(ctx, streams, pre_mix, hash_ids)
        entry = self.graphs.get(key)
        if entry is None:
            # copied and listed before anything runs: an index source among the trimmed layers adds its top-k
            # to the context it is given (the live one in the direct run, the static one while capturing),
            # which would shift the list against a later call's inputs
            static = _static_copy(ctx, streams, pre_mix, hash_ids)
            static_inputs = _inputs(*static)
            # the direct run reads a copy made as the static one is: if the compiled blocks' guards tell the
            # copies from the live inputs, they recompile here, not inside the capture (where tracing fails)
            warm = _static_copy(ctx, streams, pre_mix, hash_ids)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                hidden = self.model.run_trimmed(warm[0], cache, *warm[1:])
            torch.cuda.current_stream().wait_stream(side)
            hidden.record_stream(torch.cuda.current_stream())  # made on the side stream, used and freed on this one
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model.run_trimmed(static[0], cache, *static[1:])
            self.graphs[key] = (graph, static_inputs, out)
            return hidden
        graph, static_inputs, out = entry
        for dst, src in zip(static_inputs, _inputs(ctx, streams, pre_mix, hash_ids)):
            dst.copy_(src)
        graph.replay()
        return out.clone()  # the next replay rewrites the graph's output buffer
