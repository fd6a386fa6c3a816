"""scripts/parallel_check.py on CPU: 2 gloo processes (test_parallel's harness) check the tiny preset. Right
shardings pass the teacher-forced sublayer check; one whose ranks all keep rank 0's attention heads fails it,
worst at an attention."""

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from script_module import load_script
from test_parallel import WORLD, as_torchrun_rank, free_port

from dsflash_compile import parallel

ARGS = ["--preset", "tiny", "--prompt", "12", "--steps", "2", "--new-tokens", "2"]


def worker(rank, port, folder):
    as_torchrun_rank(rank, port)
    parallel_check = load_script("parallel_check")

    results = {"right": parallel_check.main([*ARGS, "--modes", "tp", "ep", "dp+ep"])}
    shard = parallel.shard_attention
    parallel.shard_attention = lambda attn, _rank, tp, group: shard(attn, 0, tp, group)  # every rank: heads of 0
    results["wrong"] = parallel_check.main([*ARGS, "--modes", "tp"])
    parallel.shard_attention = shard
    torch.save(results, Path(folder) / f"rank{rank}.pt")


def test_sublayer_check_passes_right_shardings_and_fails_a_wrong_one(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    results = torch.load(tmp_path / "rank0.pt")
    for mode, r in results["right"].items():
        assert r["passed"] and r["sublayers"] < 0.02, (mode, r)
    ep = results["right"]["ep"]  # whole experts and fp32 partial sums: exact (TP's bf16 expert partials are not)
    assert ep["sublayers"] == 0 and ep["logits"] == 0 and ep["greedy_equal"], ep
    wrong = results["wrong"]["tp"]
    assert not wrong["passed"] and wrong["sublayers"] > 0.1 and wrong["worst"][1] == "attn", wrong


def test_sublayer_error_counts_nan_as_inf_and_refuses_unforced_inputs():
    parallel_check = load_script("parallel_check")
    x, y = torch.ones(2, 3, 4), torch.full((2, 3, 4), 2.0)
    want = {(0, "attn"): [(x, y)], (0, "ffn"): [(x, y)]}
    assert parallel_check.sublayer_error(want, want, slice(None)) == (0.0, None)
    got = {(0, "attn"): [(x, y)], (0, "ffn"): [(x, y.clone().fill_(float("nan")))]}
    assert parallel_check.sublayer_error(got, want, slice(None)) == (float("inf"), (0, "ffn"))
    assert parallel_check.sublayer_error({k: [(x[1:], y[1:])] for k in want}, want, slice(1, 2)) == (0.0, None)
    with pytest.raises(RuntimeError, match="layer 0 attn did not run on the forced input"):
        parallel_check.sublayer_error({k: [(x + 1, y)] for k in want}, want, slice(None))
