"""The one post-grad pass Inductor runs for us: it applies our passes in order and counts what each did.

`uuid()` hashes the passes' source files (and their shared graph_edit.py) and every option that changes a
rewrite, so Inductor's FX graph cache stays on and never serves a graph rewritten by other passes or options.
"""

from __future__ import annotations

import hashlib
import inspect
import json

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import graph_edit


class DsflashPassManager(CustomGraphPass):
    def __init__(self, passes: list):
        self.passes = list(passes)
        self.matches: dict[str, int] = {p.name: 0 for p in self.passes}

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            self.matches[p.name] += p.apply(graph)

    def uuid(self) -> str:
        h = hashlib.sha256()
        for p in self.passes:
            h.update(inspect.getsource(type(p)).encode())
            h.update(inspect.getsource(inspect.getmodule(type(p))).encode())
            h.update(json.dumps(p.options, sort_keys=True).encode())
        h.update(inspect.getsource(graph_edit).encode())  # the helpers the passes' modules import
        h.update(inspect.getsource(DsflashPassManager).encode())
        return h.hexdigest()
