"""Benchmark of one mHC seam at the release dims (hc = 4, D = 5120) on one GPU:

  eager      the model's functions unfused (hc_post, hc_mixes + Sinkhorn, hc_pre, RMSNorm): day-zero
  compiled   the same, torch.compile without our passes (Inductor's own fusion)
  fused      dsflash::mhc_seam (the Triton kernel, one launch)
  pass       the same function compiled with the mHC fusion pass (what the model runs)

    python scripts/bench_mhc.py      (writes benchmarks/results/mhc-<date>.json)

Correctness first: the kernel against the reference at 1..300 tokens (max abs and relative errors of the new
streams, the normed output and the fp32 mixes; the entry variant too; a repeated call gives identical bits;
the normed output and mixes also against the reference applied to the kernel's own new streams); and whether
the pass fused the seam compiled for CUDA (`pass_matches`, 1 expected). Timings are CUDA-graph replays (median; launches excluded) at
1, 4, 16 and 64 tokens, plus the eager path with its launches. Targets (BENCHMARKS.md): fused >= 3x
unfused at 1-16 tokens, <= 10 us at 1 token. A failing check or timing point is reported and the run goes on.
"""

from __future__ import annotations

import argparse

import torch
from torch._inductor import config as inductor_config

from dsflash_compile.benchmarking import (fused_speedups, print_table, run_metadata, save_results, time_eager, time_graph,
                                          timed)
from dsflash_compile.custom_ops.mhc import entry_seam_reference, seam_reference
from dsflash_compile.layers import RMSNorm
from dsflash_compile.mhc import hc_mixes, hc_post, hc_pre
from dsflash_compile import passes
from dsflash_compile.passes import DsflashPassManager, MhcFusionPass

HC, DIM, NORM_EPS, HC_EPS, ITERS = 4, 5120, 1e-20, 1e-6, 20
COLUMNS = [("tokens", "tokens", "d"), ("eager+launch us", "eager_launches_s", ".2f", 1e6),
           ("eager us", "eager_graph_s", ".2f", 1e6), ("compiled us", "compiled_graph_s", ".2f", 1e6),
           ("fused us", "fused_graph_s", ".2f", 1e6), ("pass us", "pass_graph_s", ".2f", 1e6),
           ("matched", "pass_matches", "d"), ("x eager", "fused_vs_eager", ".1f"),
           ("x compiled", "fused_vs_compiled", ".1f")]


def make_case(tokens: int, gen: torch.Generator) -> dict:
    """Decode-shaped [tokens, 1, hc, D] inputs and the release's parameter dtypes, random and never zero."""
    mix = (2 + HC) * HC
    kw = dict(generator=gen, device="cuda")
    return dict(out=torch.randn(tokens, 1, DIM, **kw).bfloat16(),
                streams=torch.randn(tokens, 1, HC, DIM, **kw).bfloat16(),
                post=2 * torch.rand(tokens, 1, HC, **kw), comb=torch.rand(tokens, 1, HC, HC, **kw),
                pre_lagged=torch.rand(tokens, 1, HC, **kw) + 0.5, fn=torch.randn(mix, HC * DIM, **kw) * 0.01,
                scale=torch.rand(3, **kw) + 0.5, base=torch.randn(mix, **kw) * 0.5,
                norm_weight=(torch.rand(DIM, **kw) + 0.5).bfloat16())


def errors(got, want) -> dict:
    """Max absolute error and the same relative to the largest reference value, over the tensors."""
    abs_err = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
    return {"abs": abs_err, "rel": abs_err / max(w.float().abs().max().item() for w in want)}


def fused(c: dict):
    return torch.ops.dsflash.mhc_seam(c["out"], c["streams"], c["post"], c["comb"], c["pre_lagged"], c["fn"],
                                      c["scale"], c["base"], c["norm_weight"], NORM_EPS, HC_EPS, ITERS)


def seam_function(norm: RMSNorm):
    """The seam as the model writes it (DeepseekV41Block.forward), for eager and torch.compile."""
    def seam(out, streams, post, comb, pre_lagged, fn, scale, base):
        new = hc_post(out, streams, post, comb)
        pre, post, comb = hc_mixes(new, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
        return new, norm(hc_pre(new, pre_lagged)), pre, post, comb
    return seam


def unfused_args(c: dict) -> tuple:
    return c["out"], c["streams"], c["post"], c["comb"], c["pre_lagged"], c["fn"], c["scale"], c["base"]


def check(gen: torch.Generator) -> dict:
    rows = []
    for tokens in (1, 4, 16, 64, 300):
        c = make_case(tokens, gen)
        args = (c["out"], c["streams"], c["post"], c["comb"], c["pre_lagged"], c["fn"], c["scale"], c["base"],
                c["norm_weight"], NORM_EPS, HC_EPS, ITERS)
        got, again = fused(c), fused(c)
        want = seam_reference(*args)
        own = entry_seam_reference(got[0], *args[4:])  # the rest, from the kernel's own new streams
        entry = torch.ops.dsflash.mhc_entry_seam(*args[1:2], *args[4:])
        want_entry = entry_seam_reference(*args[1:2], *args[4:])
        row = {"tokens": tokens, "repeatable": all(torch.equal(a, b) for a, b in zip(got, again)),
               "streams": errors(got[:1], want[:1]), "normed": errors(got[1:2], own[:1]),
               "mixes": errors(got[2:], own[1:]), "entry_normed": errors(entry[:1], want_entry[:1]),
               "entry_mixes": errors(entry[1:], want_entry[1:]),
               "normed_vs_reference": errors(got[1:2], want[1:2]), "mixes_vs_reference": errors(got[2:], want[2:])}
        print("check", row)
        rows.append(row)
    # bf16 outputs: about one ulp of the largest value (2^-8 relative); fp32 mixes: summation order only
    bad = [r["tokens"] for r in rows if not r["repeatable"]
           or max(r[k]["rel"] for k in ("streams", "normed", "entry_normed")) > 2 ** -7
           or max(r[k]["abs"] for k in ("mixes", "entry_mixes")) > 1e-5]
    if bad:
        print(f"CHECK FAILED: the Triton seam disagrees with the reference at {bad} tokens (timings go on)")
    return {"kernel": rows, "ok": not bad}


def compile_seam(norm: RMSNorm, with_pass: bool):
    """The seam compiled afresh (dynamo reset: both variants share the seam's code object), with or without
    the mHC pass; returns (compiled fn, pass manager or None). Compiles at the first call."""
    torch._dynamo.reset()
    manager = DsflashPassManager([MhcFusionPass(NORM_EPS, HC_EPS, ITERS)]) if with_pass else None
    passes.use(manager)
    return torch.compile(seam_function(norm), fullgraph=True), manager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = run_metadata()
    result["check"] = check(gen)
    result["shapes"] = {"hc": HC, "dim": DIM, "sinkhorn_iters": ITERS}

    rows = []
    with torch.no_grad(), inductor_config.patch(force_disable_caches=True):
        norm = RMSNorm(DIM, NORM_EPS).cuda()
        for tokens in (1, 4, 16, 64):
            c = make_case(tokens, gen)
            norm.weight.data = c["norm_weight"]
            eager = seam_function(norm)
            row = {"tokens": tokens}
            timed(row, "eager_launches_s", lambda: time_eager(lambda: eager(*unfused_args(c)), iters=20))
            timed(row, "eager_graph_s", lambda: time_graph(lambda: eager(*unfused_args(c))))
            timed(row, "fused_graph_s", lambda: time_graph(lambda: fused(c), calls=50, replays=50))
            compiled, _ = compile_seam(norm, with_pass=False)
            timed(row, "compiled_graph_s", lambda: time_graph(lambda: compiled(*unfused_args(c))))
            with_pass, manager = compile_seam(norm, with_pass=True)
            timed(row, "pass_graph_s", lambda: time_graph(lambda: with_pass(*unfused_args(c)), calls=50, replays=50))
            row["pass_matches"] = manager.matches["mhc_fusion"]  # 1: the seam compiled for CUDA was fused
            passes.use(None)
            fused_speedups(row)
            print(row)
            rows.append(row)
    result["seam"] = rows

    print()
    print_table(rows, COLUMNS)
    save_results(result, "mhc", args.out)


if __name__ == "__main__":
    main()
