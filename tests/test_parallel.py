"""parallel.py on CPU: 2 processes over gloo shard the tiny model (TP, EP, TP+EP, DP attention + EP) and
match the unsharded model's logits on a prompt and decode steps with the cache, and its greedy tokens.

One spawn for the module: the workers run every mode and send their results back; the tests compare them
with the unsharded model run here.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_model import left_pad, prompts

from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.parallel import (
    LAYOUT_NAMES,
    ParallelConfig,
    all_gather,
    all_gather_rows,
    layout,
    parallelize,
)
from dsflash_compile.presets import preset_model

WORLD = 2
MODES = {  # name -> (parallel.layout's name, expert path or native weights, max |logit - unsharded logit|)
    # Routed experts TP-split: each rank's share of an expert's output is rounded to bf16 before the sum (the
    # unsharded model rounds the whole once); router and indexer top-k choices amplify the ulps (0.09 measured)
    "tp": ("tp", "loop", 0.15),
    # Whole experts per rank, nothing else split: exact
    "ep": ("ep", "loop", 0.0),
    "ep grouped": ("ep", "grouped", 0.0),
    # and fp32 partial sums for wo_b and the shared expert (in the MoE's one all-reduce): exact
    "tp+ep": ("tp+ep", "grouped", 0.0),
    # Native weights: the FP8 ops round each rank's partial to bf16 (wo_b then sums in bf16, the shared
    # expert in fp32; 0.078 measured), which flips a greedy token here
    "tp+ep native": ("tp+ep", "native", 0.15),
    # Attention and the dense GEMMs run on one request instead of two: MKL rounds the other shape differently
    # (see test_model's ragged batch test; 0.028 measured)
    "dp+ep": ("dp+ep", "grouped", 0.1),
}
DECODE_STEPS, NEW_TOKENS = 3, 4


def tiny(path: str):
    """The seeded tiny model: bf16 weights, or with path "native" the release's FP8 / MXFP4 bytes (grouped)."""
    return preset_model("tiny", seed=0, **({"weights": "native"} if path == "native" else {}))


def inputs():
    ids, mask = left_pad(prompts([19, 12]))
    steps = torch.randint(3, 512, (2, DECODE_STEPS), generator=torch.Generator().manual_seed(1))
    return ids, mask, steps


@torch.no_grad()
def run(model, ids, mask, steps, grouped):
    """Prefill and decode logits [B, S + steps, V] with one cache, and greedy generate() tokens."""
    if grouped and not model.model.layers[0].ffn.grouped:
        for block in model.model.layers:
            block.ffn.stack_experts()
    batch = ids.shape[0]
    cache = model.new_cache(batch, ids.shape[1] + DECODE_STEPS)
    logits = [model(ids, attention_mask=mask, cache=cache).logits]
    for i in range(DECODE_STEPS):
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], 1)
        logits.append(model(steps[:, i:i + 1], attention_mask=mask, cache=cache).logits)
    tokens = model.generate(ids, attention_mask=mask[:, :ids.shape[1]], max_new_tokens=NEW_TOKENS, do_sample=False)
    return torch.cat(logits, 1), tokens


def worker(rank, port, folder):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    ids, mask, steps = inputs()
    results = {}
    for name, (mode, path, _) in MODES.items():
        config = layout(mode, WORLD)
        model = parallelize(tiny(path), config, dist.group.WORLD)
        if config.dp_attention:  # each rank owns one request
            results[name] = run(model, ids[rank:rank + 1], mask[rank:rank + 1], steps[rank:rank + 1],
                                path == "grouped")
        else:
            results[name] = run(model, ids, mask, steps, path == "grouped")
    dp = model.model.layers[-1]  # the last mode's: DP attention
    # Sharded loading: each rank reads its own experts from the saved tiny model
    model = DeepseekV41ForCausalLM.from_pretrained(folder / "tiny", parallel=(layout("tp+ep", WORLD),
                                                                              dist.group.WORLD))
    results["loaded tp+ep"] = run(model, ids, mask, steps, True)
    results["loaded experts"] = [len(block.ffn.experts) for block in model.model.layers]
    results["loaded meta"] = any(t.is_meta for t in model.state_dict().values())
    # Dynamo captures the collectives without graph breaks (fullgraph): all-gather / reduce-scatter of the
    # DP-attention MoE, the MoE's all-reduce and the row-parallel wo_b of TP + EP
    tp = parallelize(preset_model("tiny", seed=0), layout("tp+ep", WORLD), dist.group.WORLD).model.layers[-1]
    tp.ffn.stack_experts()  # the grouped path (the loop syncs with the host)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, tp.ffn.gate.weight.shape[1], dtype=torch.bfloat16, generator=gen)
    o = torch.randn(2, 5, tp.attn.wo_b.in_features, dtype=torch.bfloat16, generator=gen)
    with torch.no_grad():
        results["compiled"] = [(torch.compile(m, backend="eager", fullgraph=True)(t), m(t))
                               for m, t in ((dp.ffn, x), (tp.ffn, x), (tp.attn.wo_b, o))]
    # One packed all-gather (odd widths, four dtypes, 1-D, 3-D and strided tensors) equals one all-gather per tensor
    gen = torch.Generator().manual_seed(3 + rank)
    parts = [torch.randn(3, 5, generator=gen).bfloat16(), torch.randint(-9, 9, (3, 3), generator=gen),
             torch.rand(3, generator=gen), torch.randn(3, 2, 3, generator=gen).half(),
             torch.randint(0, 9, (2, 3), generator=gen).t()[:, :1]]  # a strided last dim
    results["packed"] = ([t.clone() for t in all_gather_rows(parts, dist.group.WORLD)],  # views of one buffer
                         [all_gather(t, dist.group.WORLD) for t in parts])
    torch.save(results, folder / f"rank{rank}.pt")
    dist.destroy_process_group()


def as_torchrun_rank(rank: int, port: int) -> None:
    """The environment torchrun gives a rank (init_distributed reads it), in a spawned test process."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """{rank: {mode: (logits, tokens)}} from one spawn of WORLD gloo processes (a failing rank's traceback
    is raised here)."""
    folder = tmp_path_factory.mktemp("parallel")
    preset_model("tiny", seed=0).save_pretrained(folder / "tiny")
    mp.spawn(worker, args=(free_port(), folder), nprocs=WORLD)
    return {rank: torch.load(folder / f"rank{rank}.pt") for rank in range(WORLD)}


@pytest.fixture(scope="module")
def reference():
    ids, mask, steps = inputs()
    return {path: run(tiny(path), ids, mask, steps, path == "grouped") for path in ("loop", "grouped", "native")}


@pytest.mark.parametrize("mode", MODES)
def test_sharded_logits_and_tokens_match_the_unsharded_model(sharded, reference, mode):
    """Prompt + decode logits with the cache within the mode's bound (see MODES); greedy tokens identical
    (but with native weights). Under DP attention rank r ran request r alone."""
    name, path, bound = MODES[mode]
    want_logits, want_tokens = reference[path]
    for rank in range(WORLD):
        logits, tokens = sharded[rank][mode]
        rows = slice(rank, rank + 1) if layout(name, WORLD).dp_attention else slice(None)
        err = (logits - want_logits[rows]).abs().max().item()
        assert err <= bound, (mode, rank, err)
        if path != "native":  # its ~0.1 moves flip greedy tokens at small margins
            assert torch.equal(tokens, want_tokens[rows]), (mode, rank)


def test_each_rank_loads_its_own_experts(sharded, reference):
    want_logits, want_tokens = reference["grouped"]
    for rank in range(WORLD):
        logits, tokens = sharded[rank]["loaded tp+ep"]
        assert torch.equal(logits, want_logits) and torch.equal(tokens, want_tokens), rank
        assert sharded[rank]["loaded experts"] == [4] * 9 and not sharded[rank]["loaded meta"], rank


def test_sharded_modules_compile_without_graph_breaks(sharded):
    for rank in range(WORLD):
        for compiled, eager in sharded[rank]["compiled"]:
            assert torch.equal(compiled, eager)


def test_packed_all_gather_equals_one_per_tensor(sharded):
    for rank in range(WORLD):
        packed, separate = sharded[rank]["packed"]
        for got, want in zip(packed, separate, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), rank


def test_packed_all_gather_names_a_row_count_mismatch():
    with pytest.raises(ValueError, match="every tensor needs 2 rows"):
        all_gather_rows([torch.zeros(2, 3), torch.zeros(4, 3)], None)  # checked before any collective


@pytest.mark.parametrize("config, field", [
    (ParallelConfig(ep=3), "ep=3"),
    (ParallelConfig(tp=4), "tp=4"),
    (ParallelConfig(tp=2, dp_attention=True), "dp_attention"),
])
def test_config_errors_name_the_field(config, field):
    with pytest.raises(ValueError, match=f"ParallelConfig.{field}"):
        config.validate(preset_config("tiny").get_text_config(), world=4 if config.tp == 4 else 2)


def test_config_errors_name_the_model_field():
    text = preset_config("tiny", n_routed_experts=6, num_experts_per_tok=2).get_text_config()
    with pytest.raises(ValueError, match="n_routed_experts=6"):
        ParallelConfig(ep=4).validate(text, world=4)
    text = preset_config("tiny", num_attention_heads=6).get_text_config()
    with pytest.raises(ValueError, match="num_attention_heads=6"):
        ParallelConfig(tp=4).validate(text, world=4)


def test_layout_of_every_name():
    """Every sharded layout spans the whole group (4 ranks here)."""
    assert {name: layout(name, 1 if name == "1gpu" else 4) for name in LAYOUT_NAMES} == {
        "1gpu": ParallelConfig(), "tp": ParallelConfig(tp=4), "ep": ParallelConfig(ep=4),
        "tp+ep": ParallelConfig(tp=4, ep=4), "dp+ep": ParallelConfig(ep=4, dp_attention=True)}


def test_layout_errors():
    with pytest.raises(ValueError, match=r"unknown layout 'dp-ep'; choose one of 1gpu, tp, ep, tp\+ep, dp\+ep"):
        layout("dp-ep", 2)
    with pytest.raises(ValueError, match="'1gpu' needs exactly 1 rank, not world=2"):
        layout("1gpu", 2)
    for name in set(LAYOUT_NAMES) - {"1gpu"}:
        for world in (0, 1):
            with pytest.raises(ValueError, match=f"needs 2 or more ranks .*, not world={world}"):
                layout(name, world)
