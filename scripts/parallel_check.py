"""Sharded vs unsharded model on GPUs (issue 10's check), one process per GPU:

    torchrun --nproc-per-node 2 scripts/parallel_check.py --preset flash-layer [--compile] [--weights bf16]
    torchrun --nproc-per-node 4 scripts/parallel_check.py --preset flash-layer --set hidden_size=1024 ...
        (CPU ranks over gloo, at smaller dims)

Every rank builds the same seeded preset and runs it unsharded (the reference), then once per mode sharded
(parallel.py's layout over all the ranks: 2 or more): a prompt batch, decode steps with the cache and greedy
generate(). Under DP attention rank r runs request r of the batch (so the batch is the number of ranks).
Rank 0 prints per mode:
  sublayers  each attention and MoE of the sharded model fed the reference's input of the same call (teacher
             forcing, eager), against the reference's output: max |diff| / max |output| over all of them. A
             right sharding changes only rounding (partial sums over ranks: fp32 for wo_b and the shared expert,
             of partials rounded to bf16 for TP-split routed experts and native weights, whose wo_b sums in
             bf16); wrong heads, experts or sums are O(1).
  logits     end to end (compiled with --compile). With random weights at the released dims, any rounding-level
             change grows through the layers: 1-2 ulps (x (1 +- 2^-7) in bf16) on 5% of the first attention's
             outputs move flash-layer's logits by 23% of their scale on an H200. So it is judged against
  control    the unsharded model (eager) with exactly that change: the size of a rounding difference end to end.
  greedy     whether generate()'s tokens are identical (they may differ where the logits do, at small margins).
A mode passes when sublayers <= --bound and logits <= 3 x control (the second is the only check of the compiled
sharded model, whose graphs run no hooks); the script exits 1 if any mode fails.
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial

import torch
import torch.distributed as dist

import dsflash_compile
from dsflash_compile.benchmarking import assignment
from dsflash_compile.parallel import LAYOUT_NAMES, init_distributed, layout, parallelize
from dsflash_compile.presets import preset_config, preset_model

MODES = tuple(name for name in LAYOUT_NAMES if name != "1gpu")  # each checked against the unsharded model


class Taps:
    """Hooks on every block's attention and MoE recording each call's (input, output); with `forced` (another
    Taps' calls) each call's input is first replaced by the recorded one of the same call (its `rows`)."""

    def __init__(self, model, forced: dict | None = None, rows: slice = slice(None)):
        self.calls, self.forced, self.rows, self.handles = {}, forced, rows, []
        for i, block in enumerate(model.model.layers):
            for name in ("attn", "ffn"):
                module, key = getattr(block, name), (i, name)
                self.calls[key] = []
                self.handles += [module.register_forward_pre_hook(partial(self.force, key)),
                                 module.register_forward_hook(partial(self.record, key))]

    def force(self, key, _module, args):
        if self.forced is not None:
            return (self.forced[key][len(self.calls[key])][0][self.rows], *args[1:])

    def record(self, key, _module, args, out):
        self.calls[key].append((args[0].clone(), (out[0] if isinstance(out, tuple) else out).clone()))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def logits_of(model, ids, steps, noise: bool = False):
    """Prompt and decode logits [B, S + steps, V] with one cache. noise: x (1 +- 2^-7) (1-2 bf16 ulps) on a seeded
    5% of the first attention's outputs (the control)."""
    hook = model.model.layers[0].attn.register_forward_hook(one_ulp) if noise else None
    cache = model.empty_cache(ids.shape[0], ids.shape[1] + steps.shape[1])  # compiled: the runner's
    logits = [model(ids, cache=cache).logits]
    logits += [model(steps[:, i:i + 1], cache=cache).logits for i in range(steps.shape[1])]
    if hook is not None:
        hook.remove()
    return torch.cat(logits, 1)


def one_ulp(_module, _args, out):
    o, topk = out
    gen = torch.Generator(o.device).manual_seed(o.numel())
    flip = (torch.rand(o.shape, generator=gen, device=o.device) < 0.05) * torch.where(
        torch.rand(o.shape, generator=gen, device=o.device) < 0.5, -1.0, 1.0)
    return (o.float() * (1 + flip * 2.0 ** -7)).to(o.dtype), topk


@torch.no_grad()
def run(model, ids, steps, new_tokens, compile_model):
    """End-to-end logits and greedy tokens."""
    if compile_model:
        # one prefill bucket, at least the window (bounded replay's trimmed layers take the last window of it)
        bucket = max(ids.shape[1], model.model.text_config.sliding_window)
        dsflash_compile.compile(model, max_batch=ids.shape[0], max_length=bucket + max(steps.shape[1], new_tokens),
                                batch_buckets=(ids.shape[0],), prefill_buckets=(bucket,))
    # min_new_tokens: every rank generates as many tokens (under DP attention a rank that stopped at EOS would
    # leave the others waiting in the MoE's all-gather)
    return logits_of(model, ids, steps), model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                        do_sample=False)


def tapped(model, ids, steps, forced=None, rows=slice(None)) -> dict:
    """Each sublayer call's (input, output) in an eager prompt + decode steps (inputs forced: see Taps)."""
    taps = Taps(model, forced, rows)
    logits_of(model, ids, steps)
    taps.remove()
    return taps.calls


def sublayer_error(got: dict, want: dict, rows: slice) -> tuple[float, tuple | None]:
    """max |got - want| / max |want| over every sublayer call (NaN counts as inf), and the worst (layer,
    sublayer), None when all are exact. Checks first that every call ran on the forced input."""
    worst, where = 0.0, None
    for key, calls in want.items():
        for (w_in, w), (g_in, g) in zip(calls, got[key], strict=True):
            if not torch.equal(g_in, w_in[rows]):
                raise RuntimeError(f"layer {key[0]} {key[1]} did not run on the forced input")
            w = w[rows].float()
            err = ((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
            err = math.inf if math.isnan(err) else err
            if err > worst:
                worst, where = err, key
    return worst, where


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="flash-layer")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--prompt", type=int, default=64, help="prompt length")
    parser.add_argument("--steps", type=int, default=8, help="decode steps with the cache")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens")
    parser.add_argument("--weights", default=None, help="native / bf16 (default: the preset's)")
    parser.add_argument("--compile", action="store_true", help="dsflash_compile.compile each model (Inductor) for "
                        "the logits and greedy tokens (the sublayer check stays eager: hooks)")
    parser.add_argument("--bound", type=float, default=0.02, help="largest sublayer error that passes")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=INT", type=assignment,
                        help="override an integer text-config field (repeatable), e.g. smaller dims for CPU ranks")
    args = parser.parse_args(argv)
    fields = vars(preset_config(args.preset).text_config)
    unknown = [field for field, value in args.set if type(fields.get(field)) is not int or isinstance(value, bool)]
    if unknown:
        parser.error(f"--set: {', '.join(unknown)} not an integer text-config field of preset {args.preset!r} "
                     "given an integer")

    group = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    configs = {name: layout(name, world) for name in args.modes}  # a world no mode can use fails here, first;
    # what does not divide by it (experts, heads) fails in parallelize
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    overrides = dict(args.set, **({"weights": args.weights} if args.weights else {}))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (world, args.prompt), generator=gen).to(device)
    steps = torch.randint(3, 500, (world, args.steps), generator=gen).to(device)

    reference = preset_model(args.preset, device, **overrides)
    want_calls = tapped(reference, ids, steps)
    control = (logits_of(reference, ids, steps, noise=True) - logits_of(reference, ids, steps)).abs().max().item()
    want, want_tokens = run(reference, ids, steps, args.new_tokens, args.compile)
    del reference
    results = {}
    for name, config in configs.items():
        model = parallelize(preset_model(args.preset, device, **overrides), config, group)
        rows = slice(rank, rank + 1) if config.dp_attention else slice(None)
        sub, where = sublayer_error(tapped(model, ids[rows], steps[rows], want_calls, rows), want_calls, rows)
        got, tokens = run(model, ids[rows], steps[rows], args.new_tokens, args.compile)
        stats = torch.tensor([sub, (got - want[rows]).abs().max().item(), -float(torch.equal(tokens, want_tokens[rows]))],
                             device=device)
        stats = stats.nan_to_num(nan=math.inf)  # a NaN fails, whatever MAX makes of it
        dist.all_reduce(stats, dist.ReduceOp.MAX)  # worst rank; tokens: equal only if equal on every rank
        sub, logits = stats[0].item(), stats[1].item()
        results[name] = {"sublayers": sub, "worst": where, "logits": logits, "control": control,
                         "greedy_equal": stats[2].item() < 0, "passed": sub <= args.bound and logits <= 3 * control}
        if rank == 0:
            r, worst = results[name], f"layer {where[0]} {where[1]}" if where else "none"
            print(f"{name:6s} sublayers {r['sublayers']:.2e} (rank 0's worst: {worst})  logits "
                  f"{r['logits']:.3e}  control {control:.3e}  (scale {want.abs().max().item():.2f})  greedy tokens "
                  f"{'equal' if r['greedy_equal'] else 'DIFFER'}  {'ok' if r['passed'] else 'FAILED'}", flush=True)
        del model
    return results


if __name__ == "__main__":
    outcome = main()
    dist.destroy_process_group()
    sys.exit(0 if all(r["passed"] for r in outcome.values()) else 1)
