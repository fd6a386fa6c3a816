"""Sharded vs unsharded logits on GPUs (issue 10's check), one process per GPU:

    torchrun --nproc-per-node 2 scripts/parallel_check.py --preset flash-layer [--compile] [--weights bf16]

Every rank builds the same seeded preset, runs it unsharded (the reference), then once per mode sharded
(parallel.py's layout over all the ranks: 2 or more): a left-padded prompt batch, decode steps with the cache
and greedy generate(). Rank 0 prints each mode's largest logit difference and whether the greedy tokens match.
Under DP attention rank r runs request r of the batch (so the batch is the number of ranks).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import dsflash_compile
from dsflash_compile.parallel import LAYOUT_NAMES, init_distributed, layout, parallelize
from dsflash_compile.presets import preset_model

MODES = tuple(name for name in LAYOUT_NAMES if name != "1gpu")  # each checked against the unsharded model


@torch.no_grad()
def run(model, ids, steps, new_tokens, compile_model):
    """Prompt and decode logits [B, S + steps, V] with one cache, and greedy tokens."""
    if compile_model:
        dsflash_compile.compile(model, max_batch=ids.shape[0], max_length=ids.shape[1] + 64,
                                batch_buckets=(ids.shape[0],), prefill_buckets=(ids.shape[1],))
    cache = model.new_cache(ids.shape[0], ids.shape[1] + steps.shape[1])
    logits = [model(ids, cache=cache).logits]
    logits += [model(steps[:, i:i + 1], cache=cache).logits for i in range(steps.shape[1])]
    tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return torch.cat(logits, 1), tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="flash-layer")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--prompt", type=int, default=64, help="prompt length")
    parser.add_argument("--steps", type=int, default=8, help="decode steps with the cache")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens")
    parser.add_argument("--weights", default=None, help="native / bf16 (default: the preset's)")
    parser.add_argument("--compile", action="store_true", help="dsflash_compile.compile each model (Inductor)")
    args = parser.parse_args()

    group = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    configs = {name: layout(name, world) for name in args.modes}  # a world no mode can use fails here, first;
    # what does not divide by it (experts, heads) fails in parallelize
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    overrides = {"weights": args.weights} if args.weights else {}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (world, args.prompt), generator=gen).to(device)
    steps = torch.randint(3, 500, (world, args.steps), generator=gen).to(device)

    want, want_tokens = run(preset_model(args.preset, device, **overrides), ids, steps, args.new_tokens, args.compile)
    for name, config in configs.items():
        model = parallelize(preset_model(args.preset, device, **overrides), config, group)
        rows = slice(rank, rank + 1) if config.dp_attention else slice(None)
        got, tokens = run(model, ids[rows], steps[rows], args.new_tokens, args.compile)
        err = (got - want[rows]).abs().max()
        same = torch.tensor(float(torch.equal(tokens, want_tokens[rows])), device=device)
        dist.all_reduce(err, dist.ReduceOp.MAX)
        dist.all_reduce(same, dist.ReduceOp.MIN)
        if rank == 0:
            print(f"{name:6s} max |logit diff| {err.item():.3e}  greedy tokens {'equal' if same else 'DIFFER'}  "
                  f"(logit scale {want.abs().max().item():.2f})", flush=True)
        del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
