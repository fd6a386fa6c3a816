"""Running Triton kernels under the CPU interpreter from the test suite.

TRITON_INTERPRET is read when triton (and its own jitted helpers) are first imported, and this process
imported triton at collection, so interpreter checks run in a subprocess with the variable set from the
start. A check function prints one `CASE {json}` line per case; `run_interpreted` collects them by name.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest


def interpreter_skip_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if numpy.lib.NumpyVersion(numpy.__version__) >= "2.4.0":
        return (f"triton's interpreter fails with numpy {numpy.__version__} >= 2.4 (int() of a 1-element "
                "array in triton/runtime/interpreter.py); install numpy<2.4 to run these")
    return None


def requires_interpreter(test):
    """Skip `test` where the interpreter cannot run (see interpreter_skip_reason)."""
    reason = interpreter_skip_reason()
    return pytest.mark.skipif(reason is not None, reason=str(reason))(test)


def report(result: dict) -> None:
    """Called inside the subprocess: one case's measurements."""
    print("CASE " + json.dumps(result), flush=True)


def report_each(cases: dict, run) -> None:
    """Called inside the subprocess: `run(name, spec)` (a dict of measurements) for every case, each reported under
    its name; an error is reported as its case's result, so one failing case does not hide the others."""
    for name, spec in cases.items():
        try:
            result = {"name": name, **run(name, spec)}
        except Exception as e:  # noqa: BLE001 - reported against its case
            result = dict(name=name, error=f"{type(e).__name__}: {e}")
        report(result)


def run_interpreted(module: str, function: str, timeout: int = 600) -> dict:
    """Run tests/<module>.<function>() with TRITON_INTERPRET=1; returns {case name: result dict}."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    tests_dir = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {tests_dir!r}); import {module}; {module}.{function}()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            result = json.loads(line[5:])
            results[result["name"]] = result
    return results
