"""How much SWA bounded replay changes what the model says: replay on vs off, same weights, same prompts.

    python scripts/replay_accuracy.py [--preset tiny] [--model FOLDER] [--prompts 200] [--lengths 24 64 200]
                                      [--new-tokens 16] [--device cpu] [--out benchmarks/results]

For each prompt length, random prompts (seeded) are generated greedily with replay off (exact). Then:
  - teacher-forced agreement: the replay-on model fed the same tokens; the share of the N next-token
    argmaxes that match, and the mean KL(off || on) of the next-token distributions;
  - free-running: greedy generation with replay on; the share of prompts whose N tokens all match, and the
    mean position of the first differing token (N when none differs);
  - control (noise floor, `control_*` keys): the same metrics for replay off with the prompt prefilled in two
    chunks, [0, L - window) and the last window (as many rows as the replayed layers run), against one chunk.
    Exact in math (the cache carries every state across chunks), so whatever differs is rounding of other
    kernel shapes (e.g. bf16 GEMMs on the GPU; on the CPU mostly none), grown where it moves a value across an
    FP8 / FP4 step: how often near-ties flip with no approximation at all;
  - margins: the top-1 margin of the replay-off next-token distributions (log p1 - log p2, nats): its median
    and 10th percentile, the share of positions above each of --margins and the teacher-forced agreement on
    those positions only, and the largest margin at which replay (or the control) flipped a teacher-forced
    argmax or first diverged in greedy generation.
Prompts no longer than the window are not trimmed, so they are exact by construction (reported as such;
they get no control).
Per batch of prompts and setting: one prefill, whose cache is saved, then the greedy steps, then the cache put
back and the replay-off tokens fed as one chunk (every setting alike, so the KL compares like with like).
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

SETTINGS = (("replay", ""), ("ctl", "control_"))  # (table header, key prefix) of what is compared with replay off


def prepare(model) -> None:
    """Routed experts as grouped GEMMs (the layout compile() uses; on the CPU the loop's bits): the eager
    reference loop synchronises with the host once per expert and layer and launches each expert's ops
    separately (about half of an eager step's ~1100 launches per layer)."""
    for layer in model.model.layers:
        layer.ffn.ensure_grouped(shared=layer.ffn.can_stack_shared())


@torch.no_grad()
def run(model, prompts: torch.Tensor, new_tokens: int, replay: bool, forced: torch.Tensor | None = None,
        split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy tokens [B, N], fp32 log-probs [B, N, V]) with bounded replay on or off: the log-probs of the next
    token at each of the N positions when the continuation is `forced` (default: these greedy tokens), its
    first N - 1 tokens fed as one chunk into the prompt's cache (saved before the greedy steps, put back after).
    split: prefill the prompt as two chunks, [0, split) and the rest (the control, with replay off)."""
    model.model.text_config.swa_bounded_replay = replay
    cache = model.new_cache(prompts.shape[0], prompts.shape[1] + new_tokens)
    for chunk in (prompts,) if split is None else (prompts[:, :split], prompts[:, split:]):
        logits = [model(chunk, cache=cache, logits_to_keep=1).logits.float()]
    saved = cache.save_state()
    tokens = [logits[0][:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        tokens.append(model(tokens[-1][:, None], cache=cache).logits[:, -1].argmax(-1))
    tokens = torch.stack(tokens, 1)
    if new_tokens > 1:
        cache.restore_state(saved)
        logits.append(model((tokens if forced is None else forced)[:, :-1], cache=cache).logits.float())
    return tokens, torch.log_softmax(torch.cat(logits, 1), -1)


def compare(model, prompts: torch.Tensor, new_tokens: int) -> dict[str, torch.Tensor]:
    """Per position [B, N]: the replay-off top-1 margin, and for replay on ('' keys) and, where the prompt is
    longer than the window, the control ('control_' keys): whether the teacher-forced argmax agrees with replay
    off's, KL(off || it), and whether its greedy token differs."""
    exact_tokens, exact = run(model, prompts, new_tokens, replay=False)
    top2 = exact.topk(2, -1).values
    positions = {"margin": top2[..., 0] - top2[..., 1]}
    settings = {"": {"replay": True}}
    window = model.model.text_config.sliding_window
    if prompts.shape[1] > window:
        settings["control_"] = {"replay": False, "split": prompts.shape[1] - window}
    for prefix, setting in settings.items():
        tokens, logprobs = run(model, prompts, new_tokens, forced=exact_tokens, **setting)
        # both argmaxes from a chunk: chunk and one-token steps round differently (GPU), so near-ties may flip
        positions[prefix + "agrees"] = logprobs.argmax(-1) == exact.argmax(-1)
        positions[prefix + "kl"] = (exact.exp() * (exact - logprobs)).sum(-1)
        positions[prefix + "differs"] = tokens != exact_tokens
    return positions


def largest(values: torch.Tensor) -> float | None:
    return values.max().item() if values.numel() else None


def summarize(positions: dict[str, torch.Tensor], margins: list[float]) -> dict:
    """A row's metrics from compare()'s per-position tensors (all batches of a length concatenated)."""
    margin = positions["margin"]
    row = {"margin_median": margin.median().item(), "margin_p10": margin.quantile(0.1).item()}
    for threshold in margins:
        row[f"share_margin_over_{threshold:g}"] = (margin > threshold).float().mean().item()
    for _, prefix in SETTINGS:
        if prefix + "agrees" not in positions:
            continue
        agrees, kl, differs = (positions[prefix + key] for key in ("agrees", "kl", "differs"))
        diverged = differs.any(1)
        first = torch.where(diverged, differs.float().argmax(1), differs.shape[1])
        row.update({prefix + "teacher_forced_argmax_agreement": agrees.float().mean().item(),
                    prefix + "mean_kl": kl.mean().item(), prefix + "max_kl": kl.max().item(),
                    prefix + "greedy_all_tokens_equal": (~diverged).float().mean().item(),
                    prefix + "greedy_token_agreement": (~differs).float().mean().item(),
                    prefix + "mean_first_divergence": first.float().mean().item(),
                    # how close to a tie the flips were: the largest replay-off margin where the teacher-forced
                    # argmax flipped, and where a greedy run first took another token (its context still equal)
                    prefix + "max_margin_flipped": largest(margin[~agrees]),
                    prefix + "max_margin_first_divergence": largest(margin[diverged].gather(1, first[diverged, None]))})
        for threshold in margins:
            above = agrees[margin > threshold]
            row[f"{prefix}teacher_forced_argmax_agreement_margin_over_{threshold:g}"] = (
                above.float().mean().item() if above.numel() else None)
    return row


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
    parser.add_argument("--margins", type=float, nargs="+", default=[0.01, 0.1, 1.0],
                        help="top-1 margins (nats) above which the agreement is also reported")
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
        row = summarize({key: torch.cat([p[key] for p in parts]) for key in parts[0]}, args.margins)
        row.update(model=name, window=text.sliding_window, prompt_len=prompts.shape[1],
                   prompts=prompts.shape[0], new_tokens=args.new_tokens,
                   trimmed=prompts.shape[1] > text.sliding_window, own_prompt=length is None)
        result["rows"].append(row)
    progress.close()

    def both(header, key, spec):  # the column for replay on and for the control
        return [(f"{who} {header}", prefix + key, spec) for who, prefix in SETTINGS]

    case = [("model", "model", "s"), ("len", "prompt_len", "d"), ("n", "prompts", "d")]
    print("\nreplay on vs off (replay) and the control (ctl: replay off, two prefill chunks vs one)")
    print_table(result["rows"], case + [("trim", "trimmed", "s"),
                                        *both("tf agree", "teacher_forced_argmax_agreement", ".3f"),
                                        *both("mean KL", "mean_kl", ".2e"), ("replay max KL", "max_kl", ".2e"),
                                        *both("greedy agree", "greedy_token_agreement", ".3f"),
                                        *both("all equal", "greedy_all_tokens_equal", ".3f"),
                                        *both("1st diff", "mean_first_divergence", ".1f")])
    margins = [("median", "margin_median", ".3f"), ("p10", "margin_p10", ".4f"),
               *both("max flip", "max_margin_flipped", ".4f"),
               *both("max 1st diff", "max_margin_first_divergence", ".4f")]
    for t in args.margins:
        margins += [(f">{t:g} share", f"share_margin_over_{t:g}", ".3f"),
                    *both(f"tf >{t:g}", f"teacher_forced_argmax_agreement_margin_over_{t:g}", ".3f")]
    print("\nreplay-off top-1 margins (nats); teacher-forced agreement on the positions whose margin is over t")
    print_table(result["rows"], case + margins)
    save_results(result, "replay-accuracy", args.out)


if __name__ == "__main__":
    main()
