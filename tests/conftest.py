"""The suite's process set-up: the CPU's bf16 GEMMs, and running in parallel with pytest-xdist, as .ci/run and
the README do (`-n 2 --dist loadfile`; a run without -n keeps its threads and order).

- oneDNN capped below its AVX512-BF16 / AMX kernels on every CPU (unless ONEDNN_MAX_CPU_ISA is set): their bf16
  dot products round differently from fp32 FMAs, which the golden fixture's bounds assume. On an AMD EPYC with
  AVX512-BF16 (12-01) test_golden's cache test moved one decode step's window slot by 8.6e-3 (rel L2, bound
  1e-4); capped, the error is 0.
- One intra-op thread per xdist worker, and in the subprocesses it starts (interpreter runs; the mp.spawn
  ranks set one themselves). Two workers with torch's default of one OpenMP thread per core oversubscribe
  the 2 cores, and OpenMP threads spin-waiting on a shared core make tiny ops 10-100x slower (see
  test_serve_bench's fixture): with -n 2 and the default threads test_a_cache_of_its_own_runs_the_blocks_eager
  took 53 s against 7 s serially. With one thread each worker has a core to itself. (OMP_WAIT_POLICY=PASSIVE
  with the default threads also works, ~6% slower.)
- Scheduling, with `--dist loadfile` only: a file's tests run on one worker in their order, so its module-scoped
  fixtures (interpreter subprocesses, the serve run, the gloo spawn) run once; the files in SPLIT, whose
  fixtures are all function-scoped, are handed out test by test instead. Work goes out most expensive first
  (SLOW_FIRST, as measured with -n 2 on the 2-core CI machine; everything else after, in collection order),
  so that short files fill the gaps at the end instead of a long one running alone.
"""

import os

import pytest

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")  # read when oneDNN first runs: before any test

WORKER = os.environ.get("PYTEST_XDIST_WORKER")

if WORKER:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"  # for the subprocesses
    import torch

    torch.set_num_threads(1)

# Files, or single tests of a SPLIT file ("file::test"), most expensive first (about how many seconds each
# took with -n 2 on the CI machine).
SLOW_FIRST = [
    "test_compile.py::test_inductor_with_passes_matches_eager",  # 130
    "test_moe_small.py",  # 85
    "test_mhc_fusion.py",  # 75
    "test_parallel.py",  # 55
    "test_mhc_overlap.py",  # 50
    "test_serve_bench.py",  # 50
    "test_compile.py::test_compiled_generate_equals_eager_and_never_recompiles",  # 50
    "test_bench_parallel.py",  # 40
    "test_parallel_check.py",  # 40
    "test_topk.py",  # 40
    "test_prefix_state.py",  # 35
    "test_compile.py::test_dynamic_shapes_reuse_one_graph_from_the_second_batch_bucket_on",  # 30
    "test_native_weights.py",  # 30
    "test_indexer_triton.py",  # 30
    "test_attention.py",  # 30
    "test_compile.py::test_one_row_generate_compiles_nothing_after_warm_up",  # 25
    "test_router_triton.py",  # 20
    "test_passes.py",  # 20
    "test_model.py",  # 15
    "test_compile.py",  # the rest of it: up to 12 each
    "test_golden.py",  # 12
    "test_replay.py",  # 10
    "test_replay_accuracy.py",  # 10
    "test_records.py",  # 10
]
SPLIT = {"test_compile.py"}  # files without module- or session-scoped fixtures


def _rank(nodeid: str) -> int:
    path, _, name = nodeid.partition("::")
    file, test = os.path.basename(path), name.split("[")[0]
    for i, entry in enumerate(SLOW_FIRST):
        if entry in (file, f"{file}::{test}"):
            return i
    return len(SLOW_FIRST)


def pytest_collection_modifyitems(config, items):
    if WORKER and config.getoption("dist", "no") == "loadfile":
        items.sort(key=lambda item: _rank(item.nodeid))  # stable: a file's tests keep their order


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SlowFirstScheduling(LoadScopeScheduling):
        """loadfile with the SPLIT files test by test; units go out in the (sorted) collection order."""

        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return nodeid if os.path.basename(path) in SPLIT else path

    config.option.loadscopereorder = False  # (xdist would order the units by their number of tests)
    return SlowFirstScheduling(config, log)
