"""Inductor with its graph caches off and its kernel caches on, for tests that count what our passes do.

A graph-cache hit (Inductor's FX graph cache, AOTAutograd's cache) skips compile_fx and so the post-grad passes,
which then neither run nor count. The kernel caches can stay: kernels that several graphs share (the tiny
model's block roles) build once, where force_disable_caches gave every graph a fresh cache directory (the tiny
model's Inductor test took 110 s cold that way, 77 s cold and 46 s warm this way)."""

from contextlib import contextmanager

from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config


@contextmanager
def graph_caches_off(**inductor_patches):
    """Within the block every compile runs compile_fx (and our passes); `inductor_patches` patch Inductor's
    config too."""
    with inductor_config.patch(fx_graph_cache=False, **inductor_patches), \
            functorch_config.patch(enable_autograd_cache=False):
        yield
