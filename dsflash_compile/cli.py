"""`dsflash` command line.

  dsflash generate --preset tiny                       random-weight preset, no download
  dsflash generate --model PATH --prompt-ids 0 17 42   a checkpoint folder in the release layout
  dsflash bench serve [options]                        the latency-throughput curve (serve_bench.py)
  dsflash bench plot RESULTS.json                      its PNG
  dsflash bench attention|indexer|prefill|decode|mhc|router|native [script options]   the scripts/ benchmarks
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
}


def run_script(name: str, args: list[str]) -> int:
    """Run scripts/<file> of a source checkout as `python scripts/<file> ARGS` would."""
    script = Path(__file__).resolve().parent.parent / "scripts" / BENCH_SCRIPTS[name][0]
    if not script.is_file():
        raise SystemExit(f"dsflash bench {name}: {script} is not there; the benchmark scripts ship with the source "
                         "checkout, not the installed package (clone the repository and `pip install -e .`)")
    saved = sys.argv
    sys.argv = [str(script), *args]  # the script's argparse reads sys.argv
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
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
    args = parser.parse_args(argv)
    if args.command == "bench":
        return cmd_bench(args, parser)
    if args.command == "generate":
        if args.max_new_tokens < 1:
            parser.error("--max-new-tokens must be >= 1")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: CUDA is not available on this machine")
        return cmd_generate(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
