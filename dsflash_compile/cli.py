"""`dsflash` command line.

  dsflash generate --preset tiny                       random-weight preset, no download
  dsflash generate --model PATH --prompt-ids 0 17 42   a checkpoint folder in the release layout
  dsflash bench serve [options]                        the latency-throughput curve (serve_bench.py)
  dsflash bench plot RESULTS.json                      its PNG
  dsflash bench attention|indexer|prefill|decode|mhc|router|native [script options]   the scripts/ benchmarks
  dsflash plan memory --gpus 4 8 --context 131072 1048576   weights per GPU and requests that fit (est)
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import torch

from .benchmarking import sync
from .presets import PRESETS


def _parse_ids(values: list[str]) -> list[int]:
    ids = [int(v) for chunk in values for v in chunk.replace(",", " ").split()]
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids needs at least one token id")
    return ids


def build_model(args):
    from .modeling_deepseek_v41 import DeepseekV41ForCausalLM
    from .presets import preset_model

    device = torch.device(args.device)
    # from_pretrained's default for checkpoints, applied to the random presets too
    weights = args.weights or ("native" if device.type == "cuda" else "bf16")
    options = {"swa_bounded_replay": args.swa_bounded_replay, "weights": weights}
    if args.model:
        return DeepseekV41ForCausalLM.from_pretrained(args.model, device_map=device, **options)
    return preset_model(args.preset, device, args.seed, **options)


def cmd_generate(args) -> int:
    model = build_model(args)
    vocab = model.config.get_text_config().vocab_size
    if args.prompt_ids:
        prompt = _parse_ids(args.prompt_ids)
        bad = [i for i in prompt if not 0 <= i < vocab]
        if bad:
            raise SystemExit(f"dsflash generate: token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
    else:
        gen = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
    ids = torch.tensor([prompt], device=model.device)
    cache = model.new_cache(1, len(prompt) + args.max_new_tokens)

    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(ids, cache=cache, logits_to_keep=1).logits
        sync(model.device)
        prefill_s = time.perf_counter() - start
        out = [int(logits[0, -1].argmax())]
        start = time.perf_counter()
        for _ in range(args.max_new_tokens - 1):
            step = torch.tensor([[out[-1]]], device=model.device)
            out.append(int(model(step, cache=cache, logits_to_keep=1).logits[0, -1].argmax()))
        sync(model.device)
        decode_s = time.perf_counter() - start

    source = args.model or f"preset {args.preset}"
    replay = "on" if model.config.get_text_config().swa_bounded_replay else "off"
    print(f"model: {source} on {model.device}; prompt {len(prompt)} tokens; greedy; bounded replay {replay}")
    print("generated ids:", " ".join(map(str, out)))
    print(f"prefill: {len(prompt) / prefill_s:.1f} tokens/s ({prefill_s * 1e3:.1f} ms)")
    if len(out) > 1:
        print(f"decode: {(len(out) - 1) / decode_s:.1f} tokens/s ({decode_s / (len(out) - 1) * 1e3:.1f} ms/token)")
    return 0


# `dsflash bench NAME ARGS...` runs scripts/FILE with ARGS: the scripts stay runnable on their own
BENCH_SCRIPTS = {
    "attention": ("bench_attention.py", "attention kernel over NVFP4 / FP8 / bf16 records vs the reference"),
    "indexer": ("bench_indexer.py", "candidate-only indexer vs dense + mask + top-k; radix top-k"),
    "prefill": ("bench_prefill.py", "TTFT with bounded replay off / on; an agentic turn with the prefix cache"),
    "decode": ("compile_and_profile.py", "a preset's decode step: day-zero vs compiled, kernels, floor"),
    "mhc": ("bench_mhc.py", "fused mHC seam vs eager and plain torch.compile"),
    "router": ("bench_router.py", "fused router vs eager and plain torch.compile"),
    "native": ("bench_native.py", "FP8 / MXFP4 native-weight kernels vs bf16 projections and grouped GEMMs"),
    "parallel": ("bench_parallel.py", ("each parallel layout vs one GPU, with the NCCL share; one process per GPU: "
                                       "torchrun --nproc-per-node N --no-python dsflash bench parallel ...")),
}


def run_script(name: str, args: list[str]) -> int:
    """Run scripts/<file> of a source checkout as `python scripts/<file> ARGS` would."""
    script = Path(__file__).resolve().parent.parent / "scripts" / BENCH_SCRIPTS[name][0]
    if not script.is_file():
        raise SystemExit(f"dsflash bench {name}: {script} is not there; the benchmark scripts ship with the source "
                         "checkout, not the installed package (clone the repository and `pip install -e .`)")
    saved = sys.argv, list(sys.path)
    sys.argv = [str(script), *args]  # the script's argparse reads sys.argv
    sys.path.insert(0, str(script.parent))  # its imports of sibling scripts (python puts the script's folder first)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved
    return 0


def add_bench(sub) -> None:
    from . import serve_bench

    bench = sub.add_parser("bench", help="benchmarks (results under benchmarks/results/)")
    which = bench.add_subparsers(dest="bench", required=True)
    serve = which.add_parser("serve", help="latency-throughput curve on the agentic workload, day-zero vs optimized",
                             description=serve_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_bench.add_arguments(serve)
    plot = which.add_parser("plot", help="the PNG of a `bench serve` result")
    plot.add_argument("results", help="serve-<preset>-<date>.json")
    plot.add_argument("--png", help="output path (default: the JSON's with .png)")
    for name, (script, summary) in BENCH_SCRIPTS.items():
        # listed for --help only: main() hands these to run_script before parsing
        which.add_parser(name, help=f"{summary} (scripts/{script}; its options pass through)", add_help=False)


def cmd_bench(args, parser) -> int:
    if args.bench == "plot":
        from .serve_plot import plot

        if not Path(args.results).is_file():
            parser.error(f"bench plot: {args.results} is not a file")
        plot(args.results, args.png)
        return 0
    from . import serve_bench

    try:
        serve_bench.check_arguments(args)
    except ValueError as error:
        parser.error(f"bench serve: {error}")
    serve_bench.run(args)
    return 0


def add_plan(sub) -> None:
    from . import memory_plan
    from .parallel import LAYOUT_NAMES

    plan = sub.add_parser("plan", help="figures computed from a config (est, nothing measured)")
    which = plan.add_subparsers(dest="plan", required=True)
    memory = which.add_parser("memory", help="native weights per GPU, cache per request, requests that fit",
                              description=memory_plan.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = memory.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=PRESETS, default="release", help="named config (default: release)")
    source.add_argument("--config", help="a config.json, or a checkpoint folder holding one")
    memory.add_argument("--gpus", type=int, nargs="+", default=[4, 8], help="GPUs per node (default: 4 8)")
    memory.add_argument("--context", type=int, nargs="+", default=[131072, 1048576],
                        help="tokens per request (default: 131072 1048576)")
    memory.add_argument("--layout", nargs="+", choices=LAYOUT_NAMES, default=["dp+ep", "tp+ep"],
                        help="parallel layouts of parallel.py (default: dp+ep tp+ep)")
    memory.add_argument("--engram", nargs="+", choices=memory_plan.ENGRAM, default=list(memory_plan.ENGRAM),
                        help="Engram tables in host memory, on every GPU, or split over the GPUs (default: all)")
    memory.add_argument("--gpu-gib", type=float, default=memory_plan.H200_GIB, help="usable GiB per GPU")
    memory.add_argument("--reserve-gib", type=float, default=0.0,
                        help="GiB per GPU kept for activations and workspace (not computed; default 0)")
    memory.add_argument("--out", default="benchmarks/results", help="folder for memory-plan-<name>-<date>.json")


def _tokens(n: int) -> str:
    return f"{n >> 20}M" if n % 2 ** 20 == 0 else f"{n >> 10}K" if n % 2 ** 10 == 0 else str(n)


def cmd_plan(args, parser) -> int:
    from . import memory_plan
    from .benchmarking import print_table, run_metadata, save_results
    from .configuration_deepseek_v41 import DeepseekV41Config
    from .presets import preset_config

    config = DeepseekV41Config.from_pretrained(args.config) if args.config else preset_config(args.preset)
    text = config.get_text_config()
    try:
        rows = memory_plan.plan(text, args.gpus, args.context, args.layout, args.engram, args.gpu_gib, args.reserve_gib)
    except ValueError as error:
        parser.error(f"plan memory: {error}")
    summary = memory_plan.summary(text, args.context)
    name = Path(args.config).stem if args.config else args.preset
    print(f"memory plan (est: computed from the config, not measured) for {name}, native weights; "
          f"{args.gpu_gib:g} GiB per GPU, {args.reserve_gib:g} GiB reserved")
    for group, gib in summary["native_gib_est"].items():
        print(f"  {group:22s} {gib:9.2f} GiB held   {summary['checkpoint_gib_est'][group]:9.2f} GiB stored")
    print(f"  {'total':22s} {summary['native_total_gib_est']:9.2f} GiB held   "
          f"{sum(summary['checkpoint_gib_est'].values()):9.2f} GiB stored (not held: {summary['not_held']})")
    print(f"  cache: {summary['cache_bytes_per_token_est']:g} B/token growing; per request " +
          ", ".join(f"{gib:.3f} GiB at {_tokens(int(c))}" for c, gib in summary["request_cache_gib_est"].items()))
    columns = [("gpus", "gpus", "d"), ("layout", "layout", "s"), ("engram", "engram", "s"),
               ("weights/GPU GiB", "weights_gib_est", ".1f"), ("free/GPU GiB", "free_gib_est", ".1f"),
               ("host GiB", "host_gib_est", ".1f")]
    for c in args.context:
        columns += [(f"req/GPU {_tokens(c)}", f"requests_per_gpu_{c}_est", "d"),
                    (f"req/node {_tokens(c)}", f"requests_per_node_{c}_est", "d")]
    print_table(rows, columns)
    result = {**run_metadata(), "figures": "est: computed from the config and the code's formats, not measured",
              "config": name, "gpu_gib": args.gpu_gib, "reserve_gib": args.reserve_gib, "summary": summary,
              "rows": rows}
    save_results(result, f"memory-plan-{name}", args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_SCRIPTS:
        return run_script(argv[1], argv[2:])  # argparse would take the script's own options (--help) as ours
    parser = argparse.ArgumentParser(prog="dsflash", description="DeepSeek-V4.1-Flash with dsflash_compile")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy generation from token ids; prints ids and tokens/s")
    which = gen.add_mutually_exclusive_group()
    which.add_argument("--preset", choices=[p for p in PRESETS if p != "release"], default="tiny",
                       help="random-weight preset (default: tiny)")
    which.add_argument("--model", help="checkpoint folder (config.json + model*.safetensors)")
    gen.add_argument("--prompt-ids", nargs="+", help="prompt token ids (space or comma separated)")
    gen.add_argument("--prompt-len", type=int, default=32, help="random prompt length when no ids are given")
    gen.add_argument("--max-new-tokens", type=int, default=16)
    gen.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--weights", choices=["native", "bf16"],
                     help="FP8/MXFP4 projections kept as stored (native) or dequantized to bf16 (default: native "
                          "on CUDA, bf16 on the CPU)")
    gen.add_argument("--no-swa-bounded-replay", dest="swa_bounded_replay", action="store_false",
                     help="run every layer on every prompt token (bounded replay is on by default: the layers "
                          "after the last KV source see only the prompt's last window of tokens)")
    add_bench(sub)
    add_plan(sub)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return cmd_bench(args, parser)
    if args.command == "plan":
        return cmd_plan(args, parser)
    if args.command == "generate":
        if args.max_new_tokens < 1:
            parser.error("--max-new-tokens must be >= 1")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: CUDA is not available on this machine")
        return cmd_generate(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
