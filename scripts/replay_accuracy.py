"""How much SWA bounded replay changes what the model says: replay on vs off, same weights, same prompts.

    python scripts/replay_accuracy.py [--preset tiny] [--model FOLDER] [--prompts 200] [--lengths 24 64 200]
                                      [--new-tokens 16] [--device cpu] [--out benchmarks/results]

For each prompt length, random prompts (seeded) are generated greedily with replay off (exact). Then:
  - teacher-forced agreement: the replay-on model fed the same tokens; the share of the N next-token
    argmaxes that match, and the mean KL(off || on) of the next-token distributions;
  - free-running: greedy generation with replay on; the share of prompts whose N tokens all match, and the
    mean position of the first differing token (N when none differs).
Prompts no longer than the window are not trimmed, so they are exact by construction (reported as such).
Per batch of prompts and setting: one prefill, whose cache is saved, then the greedy steps, then the cache put
back and the replay-off tokens fed as one chunk (both settings alike, so the KL compares like with like).
The preset is built on --device, and the routed experts run as grouped GEMMs (no host sync per expert); its
random weights come from that device's generator, so the same --seed gives other weights on CPU and GPU.
--model also runs on a checkpoint folder (e.g. the golden fixture ../shared/golden/tiny-a), including its
own prompt. Writes replay-accuracy-<date>.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from dsflash_compile import DeepseekV41ForCausalLM
from dsflash_compile.benchmarking import print_table, run_metadata, save_results
from dsflash_compile.presets import preset_model


def prepare(model) -> None:
    """Routed experts as grouped GEMMs (the layout compile() uses; on the CPU the loop's bits): the eager
    reference loop synchronises with the host once per expert and layer and launches each expert's ops
    separately (about half of an eager step's ~1100 launches per layer)."""
    for layer in model.model.layers:
        layer.ffn.ensure_grouped(shared=layer.ffn.can_stack_shared())


@torch.no_grad()
def run(model, prompts: torch.Tensor, new_tokens: int, replay: bool,
        forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy tokens [B, N], fp32 log-probs [B, N, V]) with bounded replay on or off: the log-probs of the next
    token at each of the N positions when the continuation is `forced` (default: these greedy tokens), its
    first N - 1 tokens fed as one chunk into the prompt's cache (saved before the greedy steps, put back after)."""
    model.model.text_config.swa_bounded_replay = replay
    cache = model.new_cache(prompts.shape[0], prompts.shape[1] + new_tokens)
    logits = [model(prompts, cache=cache, logits_to_keep=1).logits.float()]
    saved = [t.clone() for t in cache.tensors()]
    seen, writer = cache.seen_columns, cache.last_index_key_writer  # (the host-side state)
    tokens = [logits[0][:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        tokens.append(model(tokens[-1][:, None], cache=cache).logits[:, -1].argmax(-1))
    tokens = torch.stack(tokens, 1)
    if new_tokens > 1:
        for t, s in zip(cache.tensors(), saved):
            t.copy_(s)
        cache.seen_columns, cache.last_index_key_writer = seen, writer
        logits.append(model((tokens if forced is None else forced)[:, :-1], cache=cache).logits.float())
    return tokens, torch.log_softmax(torch.cat(logits, 1), -1)


def compare(model, prompts: torch.Tensor, new_tokens: int) -> dict:
    exact_tokens, exact_logprobs = run(model, prompts, new_tokens, replay=False)
    replay_tokens, forced = run(model, prompts, new_tokens, replay=True, forced=exact_tokens)
    kl = (exact_logprobs.exp() * (exact_logprobs - forced)).sum(-1)  # KL(off || on) per position
    differs = replay_tokens != exact_tokens
    first = torch.where(differs.any(1), differs.float().argmax(1), torch.full_like(differs[:, 0], new_tokens,
                                                                                  dtype=torch.long))
    return {"prompts": prompts.shape[0], "prompt_len": prompts.shape[1], "new_tokens": new_tokens,
            # both argmaxes from a chunk: chunk and one-token steps round differently (GPU), so near-ties may flip
            "teacher_forced_argmax_agreement": (forced.argmax(-1) == exact_logprobs.argmax(-1)).float().mean().item(),
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

    # built where it runs: flash-40l-e8's random init on the host (~20B values snapped to FP8 / MXFP4 grids,
    # ~15 CPU-minutes) and its 40 GB copy took minutes
    models = {f"preset {args.preset}": preset_model(args.preset, args.device, args.seed)}
    if args.model:
        models[args.model] = DeepseekV41ForCausalLM.from_pretrained(args.model, device_map=args.device).eval()
    for model in models.values():
        prepare(model)
    result = run_metadata()
    result.update(run_on=args.device, rows=[])
    gen = torch.Generator().manual_seed(args.seed)
    cases = []
    for name, model in models.items():
        text = model.model.text_config
        cases += [(name, length, torch.randint(3, text.vocab_size, (args.prompts, length), generator=gen))
                  for length in args.lengths]
        if args.model and name == args.model:
            own = Path(args.model) / "inputs.safetensors"
            if own.exists():  # the golden fixture's own prompt
                from safetensors.torch import load_file
                cases.append((name, None, load_file(own)["prompt_ids"]))
    progress = tqdm(total=sum(-(-prompts.shape[0] // args.batch) for *_, prompts in cases), unit="batch")
    for name, length, prompts in cases:
        model, text = models[name], models[name].model.text_config
        progress.set_description(f"{name} len {prompts.shape[1]}")
        parts = []
        for chunk in prompts.split(args.batch):
            parts.append(compare(model, chunk.to(args.device), args.new_tokens))
            progress.update()
        row = {key: sum(p[key] * p["prompts"] for p in parts) / prompts.shape[0] for key in parts[0]
               if key not in ("prompts", "prompt_len", "new_tokens", "max_kl")}
        row.update(model=name, window=text.sliding_window, prompt_len=prompts.shape[1],
                   prompts=prompts.shape[0], new_tokens=args.new_tokens, max_kl=max(p["max_kl"] for p in parts),
                   trimmed=prompts.shape[1] > text.sliding_window, own_prompt=length is None)
        result["rows"].append(row)
    progress.close()

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
