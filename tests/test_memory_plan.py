"""Memory plan (est): the planned tensors against native models built on the meta device, tensor by tensor;
the release's totals against its published sizes; the cache against MODEL.md section 7; errors; the CLI."""

import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from dsflash_compile import memory_plan as mp
from dsflash_compile.checkpoint import save_checkpoint
from dsflash_compile.parallel import LAYOUT_NAMES, parallelize
from dsflash_compile.presets import preset_config, preset_model
from dsflash_compile.pretrained import to_official

GIB = 2 ** 30


@pytest.fixture(scope="module")
def release():
    return preset_config("release").text_config


@pytest.fixture(scope="module")
def release_groups(release):
    """The release's bytes per group: held (native) and stored (its files)."""
    specs = mp.native_tensors(release)
    return mp.by_group(specs), mp.by_group(specs, mp.stored_nbytes)


@pytest.mark.parametrize("preset", ["tiny", "flash-40l-e8"])
def test_plan_matches_native_model_tensor_by_tensor(preset):
    """Every parameter and buffer of the native model (built on meta: no memory) is a planned tensor with the
    same shape, dtype and bytes, none is left over on either side, and the memory the model owns (tensors
    that are not views) equals the plan's total, group by group. The routed experts' tensors are views of the
    MoE's stacks: each stack is exactly its experts' tensors, so the plan counts the experts and not the stacks."""
    specs = {s.name: s for s in mp.native_tensors(preset_config(preset).text_config)}
    model = preset_model(preset, "meta", weights="native")
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    persistent = set(model.state_dict())  # what the loader fills (its targets)
    stacks = {n: t for n, t in tensors.items() if n.endswith("_stacked")}
    held = {n: t for n, t in tensors.items() if n not in stacks}
    assert sorted(held) == sorted(specs)
    for name, t in held.items():
        s = specs[name]
        found = (tuple(t.shape), t.dtype, t.nbytes, name in persistent)
        assert found == (s.shape, s.dtype, s.nbytes, s.persistent), name
    for name, stack in stacks.items():  # model.layers.L.ffn.w1_weight_stacked
        moe, _, leaf = name.rpartition(".")
        proj, kind, _ = leaf.split("_")
        views = [held[f"{moe}.experts.{e}.{proj}.{kind}"] for e in range(stack.shape[0])]
        assert all(v._base is stack for v in views) and sum(v.nbytes for v in views) == stack.nbytes, name
    assert all(t._base is None or any(t._base is s for s in stacks.values()) for t in held.values())
    owned = Counter()
    for name, t in tensors.items():
        if t._base is None:
            owned[mp.group_of(name)] += t.nbytes
    planned = mp.by_group(specs.values())
    assert {g: owned[g] for g in mp.GROUPS} == planned
    assert sum(owned.values()) == sum(planned.values())
    if preset == "flash-40l-e8":  # native: 15.16 GiB, 5.60 of it routed experts, 0.49 Engram tables
        assert sum(planned.values()) / GIB == pytest.approx(15.16, abs=0.01)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize("preset, world", [("tiny", 2), ("flash-layer", 4)])
def test_plan_shards_as_parallelize(preset, world, name):
    """Rank 0's share in the plan (gpu_bytes: TP dims, EP's first experts) is what parallel.py's parallelize
    keeps on rank 0, tensor by tensor: the native model on meta, sharded in a fake process group of `world`
    ranks in this one process (sharding runs no collective)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"; private, so here

    world = 1 if name == "1gpu" else world
    text = preset_config(preset).text_config
    config = mp.layout_config(name, world, text)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model = parallelize(preset_model(preset, "meta", weights="native"), config, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    held = {n: t.nbytes for n, t in tensors.items() if not n.endswith("_stacked")}  # stacks: views of experts
    for n, stack in tensors.items():  # ... of this rank's experts only, no full-size stack left behind
        if n.endswith("_stacked"):
            moe, leaf = n.rsplit(".", 1)
            proj, kind = leaf.removesuffix("_stacked").split("_")
            experts = model.get_submodule(f"{moe}.experts")
            assert stack.nbytes == sum(getattr(getattr(e, proj), kind).nbytes for e in experts), n
    planned = {s.name: mp.gpu_bytes(s, config, world, "gpu", text.n_routed_experts) for s in mp.native_tensors(text)}
    assert held == {n: b for n, b in planned.items() if b}  # 0: another rank's expert, not held here


def test_stored_bytes_match_a_saved_checkpoint(tmp_path):
    """The plan's bytes in the release's files, tensor by tensor, against what save_checkpoint writes for a
    native tiny model (quantized weights as stored, the fp32 compressor narrowed to bf16, no buffers)."""
    model = preset_model("tiny", weights="native")
    save_checkpoint({to_official(n): t for n, t in model.state_dict().items()}, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        stored = {name: f.get_tensor(name).nbytes for name in f.keys()}
    specs = mp.native_tensors(preset_config("tiny").text_config)
    assert {to_official(s.name): mp.stored_nbytes(s) for s in specs if s.persistent} == stored
    assert all(mp.stored_nbytes(s) == 0 for s in specs if not s.persistent)


def test_release_totals_against_published_sizes(release_groups):
    """The release stores 475 GB, 276 GB of it routed experts (GiB, as the sizes shown for it: in 1e9-byte GB
    the backbone alone is 501). The backbone the model holds is 466.95 GiB stored (268.95 of it experts);
    the rest is what the loader skips: the 3 draft layers (mtp.*: each estimated here as a window-only
    layer with its own 128-expert MoE, 2.40 GiB, 2.24 of it experts) and the vision tower (not estimated).
    Backbone + drafts = 275.67 / 474.14 GiB: within 0.5% of both; the ~0.9 GiB left is about a vision tower."""
    stored = release_groups[1]
    experts, total = stored["routed experts"], sum(stored.values())
    assert experts == 40 * 384 * 3 * 2304 * 5120 * 17 // 32  # half a byte per weight + a byte per 32
    assert total / GIB == pytest.approx(466.95, abs=0.01)
    draft = preset_config("release", n_routed_experts=128).text_config
    layer = [s for s in mp.native_tensors(draft) if s.name.startswith("model.layers.0.")]  # window-only, no Engram
    drafts = 3 * sum(mp.stored_nbytes(s) for s in layer)
    draft_experts = 3 * sum(mp.stored_nbytes(s) for s in layer if s.group == "routed experts")
    assert (experts + draft_experts) / GIB == pytest.approx(276, rel=0.005)
    assert (total + drafts) / GIB == pytest.approx(475, rel=0.005)
    assert total + drafts < 475 * GIB  # what is left is positive: the vision tower


def test_request_cache_is_model_section_7(release):
    """One request's cache: 890 B per token of compressed rows + index keys, the 40 FP8 rings (128 x 528 B),
    the ratio-2 sources' fp32 pending groups (kv and score) and the Engram history + length (int64)."""
    fixed = 40 * 128 * 528 + 3 * 2 * (2 * 512 * 4) + 3 * 8 + 8
    for context in (131072, 1048576):
        assert mp.request_cache_bytes(release, context) == 890 * context + fixed


def test_release_plan_rows(release, release_groups):
    """8 GPUs: rank 0's weights are its eighth of the routed experts, the dense tensors whole (DP attention) or
    the TP-split ones in eighths, the Engram tables nowhere, everywhere (does not fit) or split by rows."""
    groups = release_groups[0]
    rows = {(r["layout"], r["engram"]): r for r in mp.plan(release, gpus=(8,), layouts=("dp+ep", "tp+ep"))}
    replicated = sum(b for g, b in groups.items() if g not in ("routed experts", "engram tables"))
    split = groups["attention (TP-split)"] + groups["shared experts"]
    host = rows["dp+ep", "host"]
    assert host["weights_gib_est"] * GIB == groups["routed experts"] / 8 + replicated
    assert rows["tp+ep", "host"]["weights_gib_est"] * GIB == groups["routed experts"] / 8 + replicated - split * 7 / 8
    assert host["host_gib_est"] * GIB == groups["engram tables"]
    per_request = mp.request_cache_bytes(release, 1048576)
    assert host["requests_per_gpu_1048576_est"] == int((mp.H200_GIB * GIB - host["weights_gib_est"] * GIB) // per_request)
    assert host["requests_per_node_1048576_est"] == 8 * host["requests_per_gpu_1048576_est"]
    tp = rows["tp+ep", "host"]
    assert tp["requests_per_node_1048576_est"] == tp["requests_per_gpu_1048576_est"]  # every GPU holds every request
    assert not rows["dp+ep", "gpu"]["weights_fit"] and rows["dp+ep", "gpu"]["requests_per_node_131072_est"] == 0
    table_share = rows["dp+ep", "gpu-split"]["groups_gib_est"]["engram tables"] * GIB
    assert table_share == pytest.approx(groups["engram tables"] / 8, rel=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpus=(5,), layouts=("dp+ep",)), "ep=5 does not divide n_routed_experts=384"),
    (dict(gpus=(3,), layouts=("tp",)), "tp=3 must divide num_attention_heads"),
    (dict(gpus=(1,), layouts=("dp+ep",)), r"layout 'dp\+ep' needs 2 or more ranks"),
    (dict(gpus=(2,), layouts=("1gpu",)), "layout '1gpu' needs exactly 1 rank"),
    (dict(gpus=(0,)), "gpus 0 must be >= 1"),
    (dict(layouts=("pipeline",)), "unknown layout 'pipeline'"),
    (dict(engram=("disk",)), "unknown Engram placement 'disk'"),
    (dict(contexts=(0,)), "context 0"),
    (dict(reserve_gib=-1), "reserve_gib"),
])
def test_plan_errors(release, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mp.plan(release, **kwargs)


def test_plan_leaves_out_layouts_for_other_gpu_counts(release):
    """--gpus 1 4 --layout 1gpu dp+ep: 1gpu at 1 GPU and dp+ep at 4 (each count's own layouts), not an error."""
    rows = mp.plan(release, gpus=(1, 4), layouts=("1gpu", "dp+ep"), engram=("host",))
    assert [(row["gpus"], row["layout"]) for row in rows] == [(1, "1gpu"), (4, "dp+ep")]


def test_cli_plan_memory(tmp_path, capsys):
    from dsflash_compile.cli import main

    assert main(["plan", "memory", "--preset", "tiny", "--gpus", "2", "--context", "64", "256", "--engram", "host",
                 "gpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "est" in out and "req/node 256" in out
    result = json.loads(next(tmp_path.glob("memory-plan-tiny-*.json")).read_text())
    assert result["figures"].startswith("est") and len(result["rows"]) == 4  # 2 layouts x 2 placements
    assert {"weights_gib_est", "requests_per_gpu_64_est", "requests_per_node_256_est"} <= set(result["rows"][0])
    with pytest.raises(SystemExit):  # ep=3 does not divide tiny's 8 experts: an argparse error naming it
        main(["plan", "memory", "--preset", "tiny", "--gpus", "3", "--layout", "dp+ep", "--out", str(tmp_path)])
    assert "does not divide n_routed_experts=8" in capsys.readouterr().err
