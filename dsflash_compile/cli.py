"""`dsflash` command line.

  dsflash generate --preset tiny                       random-weight preset, no download
  dsflash generate --model PATH --prompt-ids 0 17 42   a checkpoint folder in the release layout
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .presets import PRESETS


def _parse_ids(values: list[str]) -> list[int]:
    ids = [int(v) for chunk in values for v in chunk.replace(",", " ").split()]
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids needs at least one token id")
    return ids


def build_model(args):
    from .modeling_deepseek_v41 import DeepseekV41ForCausalLM
    from .presets import preset_config

    device, replay = torch.device(args.device), {"swa_bounded_replay": args.swa_bounded_replay}
    if args.model:
        return DeepseekV41ForCausalLM.from_pretrained(args.model, device_map=device, **replay)
    torch.manual_seed(args.seed)
    with torch.device(device):
        return DeepseekV41ForCausalLM(preset_config(args.preset, **replay)).eval()


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
        _sync(model.device)
        prefill_s = time.perf_counter() - start
        out = [int(logits[0, -1].argmax())]
        start = time.perf_counter()
        for _ in range(args.max_new_tokens - 1):
            step = torch.tensor([[out[-1]]], device=model.device)
            out.append(int(model(step, cache=cache, logits_to_keep=1).logits[0, -1].argmax()))
        _sync(model.device)
        decode_s = time.perf_counter() - start

    source = args.model or f"preset {args.preset}"
    replay = "on" if model.config.get_text_config().swa_bounded_replay else "off"
    print(f"model: {source} on {model.device}; prompt {len(prompt)} tokens; greedy; bounded replay {replay}")
    print("generated ids:", " ".join(map(str, out)))
    print(f"prefill: {len(prompt) / prefill_s:.1f} tokens/s ({prefill_s * 1e3:.1f} ms)")
    if len(out) > 1:
        print(f"decode: {(len(out) - 1) / decode_s:.1f} tokens/s ({decode_s / (len(out) - 1) * 1e3:.1f} ms/token)")
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
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
    gen.add_argument("--no-swa-bounded-replay", dest="swa_bounded_replay", action="store_false",
                     help="run every layer on every prompt token (bounded replay is on by default: the layers "
                          "after the last KV source see only the prompt's last window of tokens)")
    args = parser.parse_args(argv)
    if args.command == "generate":
        if args.max_new_tokens < 1:
            parser.error("--max-new-tokens must be >= 1")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: CUDA is not available on this machine")
        return cmd_generate(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
