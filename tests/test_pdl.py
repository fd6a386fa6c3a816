"""Programmatic dependent launch (custom_ops/pdl.py).

Every dsflash kernel takes the PDL constexpr and waits first thing (the rule that keeps the stream's order); the
switch is off on the CPU and restored after `launches`; on a GPU (sm_90+) a chain of dependent ops, with a kernel
that rewrites in place what the kernel before it reads, gives the same bits with PDL as without, launched
eagerly or replayed from a CUDA graph, and the kernels really carry the launch attribute."""

import ast
import importlib
import inspect
import pkgutil
import re
import textwrap

import pytest
import torch
import triton

import dsflash_compile.custom_ops as custom_ops
from dsflash_compile.custom_ops import pdl, rope_tail_triton
from dsflash_compile.custom_ops.pdl import launch_options, launches
from dsflash_compile.rope import inverse_frequencies, rotation

requires_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                     reason="needs a CUDA device of sm_90 or later")


def dsflash_kernels():
    """(module name, kernel) for every Triton kernel (a jitted `*_kernel`) of the custom_ops package."""
    found = []
    for info in pkgutil.iter_modules(custom_ops.__path__):
        module = importlib.import_module(f"{custom_ops.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                if obj.__module__ == module.__name__:
                    found.append((info.name, obj))
    return found


def test_every_kernel_waits_first():
    kernels = dsflash_kernels()
    assert len(kernels) >= 25, [k.fn.__name__ for _, k in kernels]  # the package's kernels were found
    for module, kernel in kernels:
        name = f"{module}.{kernel.fn.__name__}"
        assert "PDL" in kernel.arg_names and kernel.params[kernel.arg_names.index("PDL")].is_constexpr, name
        body = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        lines = [ast.unparse(statement) for statement in body]
        # kernels with an EARLY switch work before their wait with it on (pdl.py): they release the next kernel
        # first and wait before any store; off, they wait first like the rest
        if "EARLY_GATE" in kernel.arg_names:  # the gate's tile and bias (weights) loaded before the wait
            assert lines[0].startswith("if EARLY_GATE:\n") and lines[1] == "pdl_wait(PDL)", (name, lines[:2])
            assert "store" not in lines[0] and set(re.findall(r"\w+_ptr", lines[0])) == {"w_ptr", "bias_ptr"}, name
        elif "EARLY_FN" in kernel.arg_names:  # the mixes' fn tile (a weight) loaded before the wait
            assert lines[0] == "if EARLY_FN:\n    fn = _fn_tile(fn_ptr, mixes, HC, D, BLOCK_D, PART)", name
            assert lines[1] == "pdl_wait(PDL)", name
        elif "PREFETCH_K" in kernel.arg_names:  # a weight's rows asked of L2 (prefetch_l2.py), no load or store
            wait = lines.index("pdl_wait(PDL)")
            before = "\n".join(lines[:wait])
            assert lines[wait - 1].startswith("if PREFETCH_K > 0:\n") and "prefetch_rows_l2(w_ptr" in before, name
            assert "load" not in before and "store" not in before, name
            assert set(re.findall(r"\w+_ptr", before)) == {"w_ptr"}, name
        elif "PREFETCH" in kernel.arg_names:
            # the attention's key records asked of L2 (hints), and with EARLY_KEY its own key row made from the key
            # projection, the norm weight and the rotation (attention_own_key.py); nothing stored
            wait = lines.index("pdl_wait(PDL)")
            prefetch, early = lines[wait - 2:wait]
            assert prefetch.startswith("if PREFETCH:\n    _prefetch_block(") and "store" not in prefetch, name
            assert set(re.findall(r"\w+_ptr", prefetch)) == {"ring_ptr", "widx_ptr", "comp_ptr", "cidx_ptr"}, name
            assert early.startswith("if EARLY_KEY:\n    own = _kv_row(") and "store" not in early, name
            assert set(re.findall(r"\w+_ptr", early)) == {"chunk_ptr", "key_w_ptr", "rot_ptr"}, name
            assert not any("_ptr" in line or "pdl" in line for line in lines[:wait - 2]), name
        elif "SHARED_FIRST" in kernel.arg_names:  # its shared program reads x (two launches back) before its wait
            assert lines[0].startswith("prog, pid_n = ") and "_ptr" not in lines[0], name
            assert lines[1].startswith("if SHARED_FIRST:\n    if prog == KK:\n        pdl_release(PDL)\n"), name
            routed, without = lines[1].split("else:\n")[1:]  # the routed programs, the kernel without it
            assert routed.startswith("        pdl_wait(PDL)\n") and without.startswith("    pdl_wait(PDL)\n"), name
            wait = lines.index("if SHARED_FIRST:\n    if prog == KK:\n        pdl_wait_only(PDL)")
            assert not any("store" in line for line in lines[:wait]), name
        elif "EARLY" in kernel.arg_names and lines[0] == "if not EARLY:\n    pdl_wait(PDL)":
            # a one-row GEMV: with EARLY it reads and sums, then waits before its first store, and lets the next
            # kernel be scheduled only then (no release)
            wait = lines.index("if EARLY:\n    pdl_wait(PDL)")
            assert not any(word in line for line in lines[:wait] for word in ("store", "atomic", "pdl_release")), name
        elif "EARLY" in kernel.arg_names:
            wait = lines.index("if EARLY:\n    pdl_wait_only(PDL)")
            assert lines[0] == "if EARLY:\n    pdl_release(PDL)\nelse:\n    pdl_wait(PDL)", (name, lines[0])
            assert not any("store" in line for line in lines[:wait]), name
        else:
            assert lines[0] == "pdl_wait(PDL)", f"{name} starts with {lines[0]!r}, not the wait (custom_ops/pdl.py)"


def test_off_on_the_cpu_and_restored_after_launches():
    assert launch_options(torch.device("cpu")) == {"PDL": False}
    before = pdl._on
    with launches(not before):
        assert pdl._on is (not before)
        with pytest.raises(RuntimeError):
            with launches(before):
                raise RuntimeError
        assert pdl._on is (not before)
    assert pdl._on is before


def chain(x, weights, rot):
    """Dependent dsflash kernels: each projection reads the previous one's output, and the RoPE rewrites in
    place the tensor the projection before it just read."""
    for w in weights:
        y = torch.ops.dsflash.bf16_linear(x, w, 1, True)
        torch.ops.dsflash.rope_(x, rot)  # x was the projection's input: rotated only after it finished reading
        x = y + x[..., :1]
    return x


@requires_hopper
def test_same_bits_with_and_without_pdl_eager_and_in_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(0)
    dim, pairs = 4096, 32
    weights = [torch.randn(dim, dim, generator=g, device="cuda").bfloat16() / 64 for _ in range(6)]
    x = torch.randn(1, dim, generator=g, device="cuda").bfloat16()
    rot = rotation(torch.tensor([7], device="cuda"), inverse_frequencies(2 * pairs, 10000.0).cuda())
    with launches(False):
        want = chain(x.clone(), weights, rot)
    assert pdl.enabled(x.device)
    with launches(True):
        eager = chain(x.clone(), weights, rot)
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static, weights, rot)
    assert torch.equal(eager, want)
    for _ in range(3):
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, want)


@requires_hopper
def test_kernels_carry_the_launch_attribute():
    x = torch.randn(1, 4, 64, device="cuda").bfloat16()
    rot = rotation(torch.tensor([3], device="cuda"), inverse_frequencies(64, 10000.0).cuda())
    for on in (True, False):
        with launches(on):
            compiled = rope_tail_triton._rope_tail_kernel[(1, 1)](x, rot, 4, 64, HEADS=4, PAIRS=32,
                                                                  **launch_options(x.device))
        assert compiled.metadata.launch_pdl is on
        assert ("griddepcontrol.wait" in compiled.asm["ptx"]) is on
