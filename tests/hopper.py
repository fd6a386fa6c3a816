"""Compile Triton kernels for sm_90 on a machine without a GPU (Triton's own ptxas): code generation
errors the interpreter cannot see, register spills, and the width of each global memory access."""

import collections
import os
import re
import subprocess
import tempfile

import pytest


def compile_for_hopper(module, spec, divisible_by_16=()):
    """Compile one kernel of `module` for sm_90. spec: (kernel name, args: name -> type such as "*bf16" or
    "i32", constexprs, num_warps[, num_stages]). divisible_by_16: arguments the launch specializes as multiples of 16
    (pointers from torch allocations, sizes that happen to be), which drive Triton's vector widths."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, args, constexprs, num_warps, *stages = spec
    fn = getattr(module, name)
    if "PDL" in fn.arg_names and "PDL" not in constexprs:  # as launched on the H200 (custom_ops/pdl.py)
        constexprs = dict(constexprs, PDL=True)
    # a constexpr left out compiles as None, which an `if FLAG:` reads as off: another kernel than the one launched
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs and p.name not in args]
    assert not missing, f"{name}: constexprs {missing} not given"
    signature = dict(args, **{arg: "constexpr" for arg in constexprs})
    attrs = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in divisible_by_16}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, **({"num_stages": stages[0]} if stages else {})})


def check_compiles_for_hopper(module, spec, divisible_by_16=()) -> dict:
    """The kernel compiles for sm_90 without local memory or register spills (ptxas puts spills in the stack
    frame, which LOCAL does not count: STACK must be 0); returns cuobjdump's resource usage ({"REG": registers,
    "STACK": stack frame bytes, ...}). divisible_by_16: as compile_for_hopper's."""
    import triton

    compiled = compile_for_hopper(module, spec, divisible_by_16)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True).stdout
    assert "LOCAL:0" in usage, f"{spec[0]} {spec[2]}: {usage}"
    counts = {key: int(value) for key, value in re.findall(r"\b([A-Z]+):(\d+)", usage)}
    assert counts["STACK"] == 0, f"{spec[0]} {spec[2]} spills: {counts}"
    return counts


def global_accesses_by_line(ptx: str) -> dict:
    """{(source file name, line): Counter of global load/store instructions (e.g. 'ld.global.v2.b32')}."""
    files = dict(re.findall(r'\.file\s+(\d+)\s+"([^"]+)"', ptx))
    where, accesses = None, collections.defaultdict(collections.Counter)
    for line in ptx.splitlines():
        loc = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", line)
        if loc:
            where = (os.path.basename(files.get(loc.group(1), "?")), int(loc.group(2)))
        access = re.search(r"\b((?:ld|st)\.global\S*)", line)
        if access:
            accesses[where][access.group(1)] += 1
    return accesses
