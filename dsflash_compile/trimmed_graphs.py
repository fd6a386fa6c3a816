"""CUDA graphs of bounded replay's trimmed layers (SYSTEM.md, bounded replay).

With bounded replay the last prompt chunk runs the layers after the last KV source on only the last
`sliding_window` columns of each row: [B, 128] at the release, whatever the prompt length. Those ~20
compiled blocks are short and launch-bound, so, like the decode step, they are captured as one CUDA graph
per batch bucket (the equivalent of compiling them with mode="reduce-overhead", with one replay for the
whole region instead of one per block), while the layers up to the cut run as the ordinary prefill chunk.

A graph is keyed by the shapes and dtypes of every input tensor (the tail context, streams, pre-mix and
any Engram ids), so a different input set captures a new graph instead of being copied into the wrong
buffers. The first call for a key runs the blocks directly on a side stream (that compiles them and does
every lazy initialisation, as capture requires) and then captures; capture records kernels without
running them, so the cache is not written twice.
"""

from __future__ import annotations

import dataclasses

import torch

from .context import ForwardContext


def _inputs(ctx: ForwardContext, streams: torch.Tensor, pre_mix: torch.Tensor, hash_ids: dict) -> list[torch.Tensor]:
    """Every tensor the trimmed part reads, in a fixed order (dict entries by key)."""
    tensors = [streams, pre_mix, ctx.positions, ctx.lengths_before, ctx.window_idx, ctx.window_slots]
    for entries in (ctx.rotations, ctx.topk, hash_ids):
        tensors += [entries[key] for key in sorted(entries)]
    return tensors + [t for t in (ctx.candidates, ctx.write_floor) if t is not None]


def _signature(ctx: ForwardContext, streams, pre_mix, hash_ids) -> tuple:
    layout = (tuple(sorted(ctx.rotations)), tuple(sorted(ctx.topk)), tuple(sorted(hash_ids)),
              ctx.candidates is None, ctx.write_floor is None, ctx.columns_after)
    return layout + tuple((tuple(t.shape), t.dtype) for t in _inputs(ctx, streams, pre_mix, hash_ids))


def _static_copy(ctx: ForwardContext, streams, pre_mix, hash_ids):
    """Clones of the inputs at fixed addresses (the graph reads these; each call copies into them)."""
    def clone(t):
        return None if t is None else t.clone()

    static_ctx = dataclasses.replace(
        ctx, positions=clone(ctx.positions), lengths_before=clone(ctx.lengths_before),
        window_idx=clone(ctx.window_idx), window_slots=clone(ctx.window_slots),
        rotations={k: clone(v) for k, v in ctx.rotations.items()}, topk={k: clone(v) for k, v in ctx.topk.items()},
        candidates=clone(ctx.candidates), write_floor=clone(ctx.write_floor))
    return static_ctx, clone(streams), clone(pre_mix), {k: clone(v) for k, v in hash_ids.items()}


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
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                hidden = self.model.run_trimmed(ctx, cache, streams, pre_mix, hash_ids)
            torch.cuda.current_stream().wait_stream(side)
            hidden.record_stream(torch.cuda.current_stream())  # made on the side stream, used and freed on this one
            static = _static_copy(ctx, streams, pre_mix, hash_ids)
            # listed before capture: an index source among the trimmed layers adds its top-k to the static
            # context while capturing, which would shift the list against the live inputs
            static_inputs = _inputs(*static)
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
