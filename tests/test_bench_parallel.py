"""scripts/bench_parallel.py on CPU: 2 gloo processes (test_parallel's harness) bench the tiny preset in three modes
at tiny sizes; the JSON has every mode's rows with positive times and communication shares in [0, 1]."""

import json
import sys

import torch.multiprocessing as mp
from script_module import SCRIPTS
from test_parallel import WORLD, as_torchrun_rank, free_port

MODES = ["1gpu", "tp+ep", "dp+ep"]  # the baseline and both dispatches (all-reduce; all-gather + reduce-scatter)
PREFILL, BATCH = 16, 2


def worker(rank, port, out):
    as_torchrun_rank(rank, port)
    sys.path.insert(0, str(SCRIPTS))  # (not load_script: bench_parallel imports its sibling compile_and_profile)
    import bench_parallel

    bench_parallel.main(["--preset", "tiny", "--modes", *MODES, "--batch", str(BATCH), "--prefill", str(PREFILL),
                         "--context", "32", "--steps", "1", "--repeats", "1", "--profile-steps", "1", "--out", out])


def test_bench_parallel_writes_every_mode_with_times_and_comm_shares(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    (path,) = tmp_path.glob("parallel-tiny-*.json")
    result = json.loads(path.read_text())
    assert result["world"] == WORLD and list(result["modes"]) == MODES
    assert not any("error" in info for info in result["modes"].values()), result["modes"]
    rows = {(r["mode"], r["phase"]): r for r in result["rows"]}
    assert sorted(rows) == sorted((mode, phase) for mode in MODES for phase in ("prefill", "decode"))
    for (mode, phase), row in rows.items():
        ranks = 1 if mode == "1gpu" else WORLD
        requests = WORLD if mode == "dp+ep" else 1  # DP attention: each rank its own requests
        assert row["tokens"] == requests * (PREFILL if phase == "prefill" else BATCH), (mode, phase)
        assert row["s"] > 0 and row["tokens_per_s"] > 0 and len(row["s_per_rank"]) == ranks, (mode, phase)
        shares = row["comm_share_per_rank"]
        assert len(shares) == ranks and all(0 <= share <= 1 for share in shares), (mode, phase, shares)
        if mode == "1gpu":
            assert shares == [0] and "speedup" not in row
        else:
            assert all(share > 0 for share in shares) and row["speedup"] > 0, (mode, phase, shares)
            assert row["tokens_per_s_vs_1gpu"] == row["tokens_per_s"] / rows["1gpu", phase]["tokens_per_s"]
