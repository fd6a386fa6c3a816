"""A CUDA graph captured in pieces that replay back to back (the compiled decode step).

cudaGraphLaunch's host time grows with the graph's kernels, and the GPU starts a graph only once its launch
is submitted: on the H200 a 1004-kernel decode step (flash-40l-e8, batch 1) took 12.6 ms for 11.7 ms from its
first kernel to its last, and its profile shows a 1.66 ms cudaGraphLaunch with the first kernel at its end. As
N graphs the GPU starts after the first piece's launch and each later launch overlaps the pieces before it: 4
pieces took 11.58 ms a step against 11.85 as one graph, side by side (12-01 l). The pieces share one memory
pool, which is safe because they always replay in the order they were captured.

The GPU still idles while the first piece launches (its kernels' share of the host time: ~0.3 ms for 10 of 40
blocks at B1), so the pieces grow (`piece_sizes`): the first holds the set-up and one block, launched in a few
tens of us, and each later piece launches while the smaller ones before it run (a block's kernels run ~8x
longer on the H200 than their host launch takes).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def piece_sizes(blocks: int, pieces: int, growth: float) -> list[int]:
    """Blocks per piece, at least one each, in proportion to growth ** i (1: even pieces); the larger pieces
    last. min(pieces, blocks) pieces."""
    pieces = min(pieces, blocks)
    weights = [growth ** i for i in range(pieces)]
    total = sum(weights)
    sizes = [1] * pieces  # each piece's one block, then the rest in proportion (largest remainders)
    shares = [(blocks - pieces) * w / total for w in weights]
    for i, share in enumerate(shares):
        sizes[i] += int(share)
    rest = blocks - sum(sizes)
    for i in sorted(range(pieces), key=lambda i: (shares[i] - int(shares[i]), i), reverse=True)[:rest]:
        sizes[i] += 1
    return sizes


class PiecewiseGraph:
    def __init__(self, pool):
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []

    @contextmanager
    def capture(self):
        """Capture the work run inside the block, on a side stream as torch.cuda.graph does; `cut()` inside it
        starts a new piece."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        with torch.cuda.stream(torch.cuda.Stream()):
            self._begin()
            try:
                yield self
            finally:
                self.graphs[-1].capture_end()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def cut(self) -> None:
        """End the piece being captured and begin the next (between two kernels of the captured work)."""
        self.graphs[-1].capture_end()
        self._begin()

    def replay(self) -> None:
        for graph in self.graphs:
            graph.replay()
