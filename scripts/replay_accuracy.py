"""How much SWA bounded replay changes what the model says: replay on vs off, same weights, same prompts.

    python scripts/replay_accuracy.py [--preset tiny] [--model FOLDER] [--prompts 200] [--lengths 24 64 200]
                                      [--new-tokens 16] [--device cpu] [--out benchmarks/results]

For each prompt length, random prompts (seeded) are generated greedily with replay off (exact). Then:
  - teacher-forced agreement: the replay-on model fed the same tokens; the share of the N next-token
    argmaxes that match, and the mean KL(off || on) of the next-token distributions;
  - free-running: greedy generation with replay on; the share of prompts whose N tokens all match, and the
    mean position of the first differing token (N when none differs).
Prompts no longer than the window are not trimmed, so they are exact by construction (reported as such).
--model also runs on a checkpoint folder (e.g. the golden fixture ../shared/golden/tiny-a), including its
own prompt. Writes replay-accuracy-<date>.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.benchmarking import print_table, run_metadata, save_results


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, new_tokens: int, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, N], fp32 log-probs [B, N, V]) of greedy decoding with replay on or off."""
    model.model.text_config.swa_bounded_replay = replay
    cache = model.new_cache(prompts.shape[0], prompts.shape[1] + new_tokens)
    logits = model(prompts, cache=cache, logits_to_keep=1).logits[:, -1]
    tokens, logprobs = [], []
    for _ in range(new_tokens):
        logprobs.append(torch.log_softmax(logits.float(), -1))
        tokens.append(logits.argmax(-1))
        logits = model(tokens[-1][:, None], cache=cache).logits[:, -1]
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


@torch.no_grad()
def teacher_forced(model, prompts: torch.Tensor, tokens: torch.Tensor, replay: bool) -> torch.Tensor:
    """fp32 log-probs [B, N, V] of the next token at each of the N given continuation tokens' positions."""
    model.model.text_config.swa_bounded_replay = replay
    cache = model.new_cache(prompts.shape[0], prompts.shape[1] + tokens.shape[1])
    logits = [model(prompts, cache=cache, logits_to_keep=1).logits[:, -1]]
    for t in range(tokens.shape[1] - 1):
        logits.append(model(tokens[:, t:t + 1], cache=cache).logits[:, -1])
    return torch.log_softmax(torch.stack(logits, 1).float(), -1)


def compare(model, prompts: torch.Tensor, new_tokens: int) -> dict:
    exact_tokens, exact_logprobs = greedy(model, prompts, new_tokens, replay=False)
    forced = teacher_forced(model, prompts, exact_tokens, replay=True)
    replay_tokens, _ = greedy(model, prompts, new_tokens, replay=True)
    kl = (exact_logprobs.exp() * (exact_logprobs - forced)).sum(-1)  # KL(off || on) per position
    differs = replay_tokens != exact_tokens
    first = torch.where(differs.any(1), differs.float().argmax(1), torch.full_like(differs[:, 0], new_tokens,
                                                                                  dtype=torch.long))
    return {"prompts": prompts.shape[0], "prompt_len": prompts.shape[1], "new_tokens": new_tokens,
            "teacher_forced_argmax_agreement": (forced.argmax(-1) == exact_tokens).float().mean().item(),
            "mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
            "greedy_all_tokens_equal": (~differs.any(1)).float().mean().item(),
            "greedy_token_agreement": (~differs).float().mean().item(),
            "mean_first_divergence": first.float().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--model", help="also run on this checkpoint folder")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--lengths", type=int, nargs="+", default=[24, 64, 200])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=50, help="prompts per forward")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    models = {f"preset {args.preset}": DeepseekV41ForCausalLM(preset_config(args.preset)).eval().to(args.device)}
    if args.model:
        models[args.model] = DeepseekV41ForCausalLM.from_pretrained(args.model, device_map=args.device).eval()
    result = run_metadata()
    result.update(run_on=args.device, rows=[])
    gen = torch.Generator().manual_seed(args.seed)
    for name, model in models.items():
        text = model.model.text_config
        cases = [(length, torch.randint(3, text.vocab_size, (args.prompts, length), generator=gen))
                 for length in args.lengths]
        if args.model and name == args.model:
            own = Path(args.model) / "inputs.safetensors"
            if own.exists():  # the golden fixture's own prompt
                from safetensors.torch import load_file
                cases.append((None, load_file(own)["prompt_ids"]))
        for length, prompts in tqdm(cases, desc=name):
            parts = [compare(model, chunk.to(args.device), args.new_tokens) for chunk in prompts.split(args.batch)]
            row = {key: sum(p[key] * p["prompts"] for p in parts) / prompts.shape[0] for key in parts[0]
                   if key not in ("prompts", "prompt_len", "new_tokens", "max_kl")}
            row.update(model=name, window=text.sliding_window, prompt_len=prompts.shape[1],
                       prompts=prompts.shape[0], new_tokens=args.new_tokens, max_kl=max(p["max_kl"] for p in parts),
                       trimmed=prompts.shape[1] > text.sliding_window, own_prompt=length is None)
            result["rows"].append(row)

    print()
    print_table(result["rows"], [("model", "model", "s"), ("len", "prompt_len", "d"), ("n", "prompts", "d"),
                                 ("trim", "trimmed", "s"), ("tf agree", "teacher_forced_argmax_agreement", ".3f"),
                                 ("mean KL", "mean_kl", ".2e"), ("max KL", "max_kl", ".2e"),
                                 ("greedy agree", "greedy_token_agreement", ".3f"),
                                 ("all equal", "greedy_all_tokens_equal", ".3f"),
                                 ("1st diff", "mean_first_divergence", ".1f")])
    save_results(result, "replay-accuracy", args.out)


if __name__ == "__main__":
    main()
