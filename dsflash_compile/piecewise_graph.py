"""A CUDA graph captured in pieces that replay back to back (the compiled decode step).

cudaGraphLaunch's host time grows with the graph's kernels, and the GPU starts a graph only once its launch
is submitted: on the H200 a 1004-kernel decode step (flash-40l-e8, batch 1) took 12.6 ms for 11.7 ms from its
first kernel to its last, and its profile shows a 1.66 ms cudaGraphLaunch with the first kernel at its end. As
N graphs the GPU starts after the first piece's launch and each later launch overlaps the pieces before it: 4
pieces took 11.58 ms a step against 11.85 as one graph, side by side (12-01 l). The pieces share one memory
pool, which is safe because they always replay in the order they were captured.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


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
