"""Compile a preset with dsflash_compile.compile and profile its decode step against the eager day-zero path.

    python scripts/compile_and_profile.py --preset flash-40l-e8 --batch 1 64 --context 4096
    python scripts/compile_and_profile.py --batch 1 64 --variants unfused,passes   # issue 5's fusions off / on

Reports, per batch size: decode step time of day-zero (eager, reference ops, bf16 caches, reference MoE
loop, no graphs), compiled without our passes and compiled with them (CUDA-graph replays); kernels per
decode step (eager vs compiled, from torch.profiler); cold and warm compile time (warm = the same
compile after torch._dynamo.reset(), served by Inductor's FX graph cache); graph breaks, graphs and
recompiles (torch._dynamo counters); pattern-match counts per pass; the top kernels by time; and the
physical floor of the step (bytes that must move over the measured copy bandwidth, or FLOPs over the
measured bf16 matmul rate, whichever is larger). The compiled variants are all compiled and captured
first, then timed in --rounds rounds whose order rotates (timed one after the other, the variant timed
second ran 1.4-1.9 ms slower on the H200 whichever it was); day-zero is timed once, before them. Each round
also times the steps launched back to back (no wait between them: the GPU's own time per step, the host's launch
hidden), so what the host adds to a waited-for step shows as the difference. Writes each
compiled variant's Chrome trace (decode-trace-PRESET-bBATCH[-VARIANT].json; no suffix for passes) and a JSON
summary (compile-profile-PRESET-bBATCH[-bBATCH...]-DATE.json) under benchmarks/results/. The cache is filled
with `--context` random rows per row (the step's cost does not depend on what the rows hold).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import tempfile
import time
import traceback
from contextlib import contextmanager

import torch
from torch._dynamo.utils import counters

import dsflash_compile
from dsflash_compile import DeepseekV41ForCausalLM, preset_config
from dsflash_compile.benchmarking import (copy_bandwidth, decode_traffic, profile_summary, run_metadata,
                                          save_results, time_eager)
from dsflash_compile.custom_ops import records
from dsflash_compile.custom_ops.dispatch import reference_kernels


# compiled variants (CompileOptions besides the defaults), in the order they run; "warm" recompiles "passes" after
# torch._dynamo.reset() (Inductor's FX graph cache)
VARIANTS = {
    "no-passes": {"passes": False},
    "argsort-moe": {"moe_count_order": 0},  # the MoE's sorts by argsort (before issue 5's counting orders)
    "torch-moe": {"moe_few_rows": 0, "moe_few_tokens": 0},  # torch._grouped_mm at every batch (before issue 5)
    "cutlass-moe": {"moe_few_rows": 112},  # torch._grouped_mm from batch 17 (before the tall row tiles, 12-02 n)
    "sorted-moe": {"moe_few_tokens": 0},  # decode's routed experts sorted and grouped (before dsflash::routed_experts)
    "routed-moe": {"moe_few_tokens": 64},  # dsflash::routed_experts at every decode batch (by expert above 16)
    "inductor-rope": {"q_rope_op": False},  # q's RoPE in Inductor's kernel over all of q's columns (before 12-02 r)
    "inductor-swiglu": {"moe_swiglu_op": False},  # the sorted path's gate/up as two GEMMs + Inductor (before 12-02 q)
    "inductor-token-sum": {"moe_token_sum_op": False},  # the sorted path's per-token sum in Inductor (before 12-02 t)
    "inductor-order": {"moe_order_op": False},  # the sorted path's counting orders in Inductor (before 12-02 q)
    "inductor-index-rope": {"index_rope_op": False},  # the indexer's query RoPE + FP4 in Inductor (before 12-02 t)
    "inductor-qdq": {"qdq_op_rows": 0},  # the projections' input FP8 in Inductor's kernels (before 12-02 s)
    "cublas-linear": {"linear_few_rows": 0},  # decode's bf16 projections on cuBLAS (before dsflash::bf16_linear)
    "cublas-plain": {"plain_linear_gemv": False},  # the unquantized one-row projections on cuBLAS (before 12-03 z)
    "tiled-linear": {"linear_gemv": False},  # one-row projections on bf16_linear's kernel (before dsflash::bf16_gemv)
    "cublas-tall": {"linear_tall": False},  # 33-64 rows of wo_a / wo_b on cuBLAS (before QuantLinear.tall_rows)
    "router-in-seam": {"router_in_seam": True},  # the router inside the FFN's deferred seam (passes/router_seam.py)
    "no-linear-rope": {"linear_rope": False},  # q's RoPE in its own launch after wq_b (before 12-04 d)
    "no-linear-scale": {"linear_scale": False},  # weights_proj's scale in its own kernel (before 12-05 f)
    "linear-norm": {"linear_norm": True},  # q's RMSNorm in wq_b's kernel (passes/linear_norm.py)
    "seam-norm-gemv": {"seam_norm_gemv": True},  # the attention seam's norm in the wq_a+wkv GEMV (off: no clear gain)
    "gemv-at-once": {},  # bf16_gemv's tiles loaded at once (AT_ONCE: every weight load before the first barrier)
    # the mHC seam kernel's fn tile after its PDL wait and the row's loads after the mixes' barriers (before 12-04 d:
    # mhc_triton.EARLY_FN, ROW_LOADS_FIRST)
    "seam-late-loads": {},
    "kv-rot-first": {},  # kv_norm_rope's cos / sin loaded with its row (kv_norm_rope_triton.ROT_FIRST)
    "loads-first": {},  # gemv-at-once and kv-rot-first together
    "seam-norm-at-once": {"seam_norm_gemv": True},  # both
    "joint-norms": {"qkv_norm_op": True},  # q's norm in kv_norm_rope's launch (dsflash::qkv_norm_rope; off: slower)
    "tiled-big-linear": {},  # one row of wq_b, wo_a, wo_b on the tiled kernel (KERNEL_SETTINGS; before 12-04 b)
    "shared-first": {},  # the MoE's shared expert streamed before the up kernel's PDL wait, beside the router
    "shared-first-128": {},  # ... with the up kernel at 128 registers a thread (4 programs an SM)
    "up-regs-128": {},  # the routed experts' up kernel at 128 registers a thread (4 programs an SM against 5)
    "down-16": {},  # the routed experts' down kernel on 16-column blocks (fewer registers, more programs an SM)
    "tma-prefetch": {},  # the TMA GEMVs ask L2 for their first num_stages tiles before their PDL wait (all three)
    "tma-prefetch-2": {},  # ... for twice that
    "no-prefetch": {},  # wo_b without its L2 prefetch before the PDL wait (before 12-04 c)
    "prefetch-wo-b-2": {},  # wo_b's L2 prefetch for twice its num_stages tiles
    "fused-mixes": {"mhc_defer_mixes": False},  # each seam finishes its own mixes (before passes/mhc_defer.py)
    "early-reads": {"early_reads": True},  # kv_norm_rope reading before its PDL wait (passes/early_reads.py)
    "early-gemv": {"early_gemv": True},  # one-row projections reading before their PDL wait (the indexer's wq_b...)
    "one-graph": {"decode_graph_pieces": 1},  # the decode step as one CUDA graph (before piecewise_graph.py)
    "even-pieces": {"decode_graph_pieces": 4, "decode_graph_growth": 1.0},  # 4 even pieces (before 12-02 s)
    "setup-piece": {"decode_graph_setup_piece": True},  # the set-up in a graph piece of its own
    # issue 5's decode fusions off: shared expert on its own GEMMs, wq_a and wkv apart, Engram and set-up eager
    "unfused": {"moe_shared_stacked": False, "fuse_input_projections": False, "compile_engram": False,
                "compile_setup": False},
    "no-shared-stack": {"moe_shared_stacked": False},
    "no-qkv-fusion": {"fuse_input_projections": False},
    "engram-eager": {"compile_engram": False},
    "setup-eager": {"compile_setup": False},
    "finish-eager": {"compile_finish": False},  # the last collapse, norm and length update eager (before 12-03 z)
    "no-pdl": {"pdl": False, "inductor_pdl": False},  # no programmatic dependent launch (before 12-02 s)
    "no-inductor-pdl": {"inductor_pdl": False},  # the dsflash kernels with PDL, Inductor's without
    "ring-write": {"decode_ring_write_op": True},  # decode writes the window ring in kv_norm_rope's launch
    "joint-ring": {"decode_ring_write_op": True, "qkv_norm_op": True},  # ... with the query's norm in it too
    "compressor-gemv": {"compressor_gemv": True},  # the compressors' fp32 wkv + wgate as one dsflash::fp32_gemv
    "engram-op": {"engram_lookup_op": True},  # the Engram table's rows by dsflash::engram_lookup
    "rope-cos-sin": {},  # RoPE rotations by cos / sin in the compiled set-up, not eager torch.polar kernels
    "single-topk": {},  # the decode top-k and its finish in one launch per row (topk_triton's single path)
    "attention-prefetch": {},  # the attention's key records asked of L2 before its PDL wait (PREFETCH_KEYS)
    "kv-first": {"kv_first": True},  # the attention's key row before wq_b: the attention follows wq_b (kv_first.py)
    "attention-prefetch-kv-first": {"kv_first": True},  # both
    # the four options of 12-04 e (written without a GPU) together; its group rows and gathered pool: every build
    "e-all": {"decode_ring_write_op": True, "compressor_gemv": True, "engram_lookup_op": True},
    # 12-05 f: e-all with the early GEMVs; also with the attention's prefetch after wq_b; and without engram-op
    "e-early": {"decode_ring_write_op": True, "compressor_gemv": True, "engram_lookup_op": True, "early_gemv": True},
    "e-early-prefetch": {"decode_ring_write_op": True, "compressor_gemv": True, "engram_lookup_op": True,
                         "early_gemv": True, "kv_first": True},
    "e-early-no-engram": {"decode_ring_write_op": True, "compressor_gemv": True, "early_gemv": True},
    # 12-05 f1's options, on since, each off
    "no-ring-write": {"decode_ring_write_op": False},
    "no-compressor-gemv": {"compressor_gemv": False},
    "no-single-topk": {},
    "no-early-gemv": {"early_gemv": False},
    "before-f1": {"decode_ring_write_op": False, "compressor_gemv": False, "early_gemv": False},  # all four off
    "topk-8-warps": {},  # the single top-k on at most 8 warps (SINGLE_MAX_WARPS; the default since 12-05 g)
    # 12-05 g1's winners together: engram-op, the attention's prefetch, the single top-k on 8 warps; also kv-first
    "g-all": {"engram_lookup_op": True},
    "g-all-kv-first": {"engram_lookup_op": True, "kv_first": True},
    "before-g": {"qkv_norm_op": False, "engram_lookup_op": False},  # 12-05 g2's defaults (and top-k warps) off
    # 12-05 h: the key row in the attention's launch (dsflash::attention_own_key_), the query's norm in wq_b's kernel
    # (linear_norm) where wq_b is its only reader; alone: the query's norm an Inductor kernel
    "own-key": {"attention_own_key": True, "linear_norm": True},
    "own-key-alone": {"attention_own_key": True},
    # 12-05 h: fewer decode graph pieces (7 by default: 1, 2, 2, 3, 5, 9, 18 blocks). In the B1 trace each piece's
    # first kernel starts ~2 us after the last of the piece before (no programmatic edge between graphs: 6 gaps,
    # 12.5 us), while a piece's launch (~0.2-1 us a kernel of host time, ~16 kernels a block) is far shorter than the
    # GPU's ~227 us a block: 3 pieces of 1, 4, 35 blocks and 4 of 1, 2, 7, 30 still launch each piece in time
    "pieces-3": {"decode_graph_pieces": 3, "decode_graph_growth": 10.0},
    "pieces-4": {"decode_graph_pieces": 4, "decode_graph_growth": 5.0},
    # 12-05 h: the set-up's 21 one-program kernels through Inductor's combo kernels; also with its rotations by cos /
    # sin (rope.COS_SIN: Inductor kernels, where torch.polar is an aten kernel no fusion takes)
    "setup-combo": {"setup_combo_kernels": True},
    "setup-combo-cos-sin": {"setup_combo_kernels": True},
    # 12-05 h: the single top-k's row as a power-of-two head and a short tail (topk_triton.SINGLE_SPLIT): the 4120-
    # and 2060-wide rows of a 4K context ranked as 4128 and 2064 entries, not 8192 and 4096. setup-combo and
    # single-split are the defaults since 12-05 k (the same build as passes)
    "single-split": {},
    # 12-05 k1's two winners (the set-up's combo kernels and the split single top-k) off
    "before-k": {"setup_combo_kernels": False},
    # 12-05 h's five together
    "h-all": {"attention_own_key": True, "linear_norm": True, "setup_combo_kernels": True, "decode_graph_pieces": 3,
              "decode_graph_growth": 10.0},
    # 12-05 i: the single top-k's k-th key by 8-bit digits (topk_triton.SINGLE_RADIX, a histogram a digit: 2 for bf16
    # scores, where the bisection takes 16 block sums), with the split row
    "single-split-radix": {},
    # 12-05 i: each KV source's compressor after its projection in one launch (dsflash::compress_token_), where
    # seven few-program kernels took 14.4 us of the path in each of the 4 sources; without its wk L2 prefetch; h-all
    # with it
    "compress-op": {"compress_token_op": True},
    "compress-op-no-prefetch": {"compress_token_op": True},
    "i-all": {"attention_own_key": True, "linear_norm": True, "setup_combo_kernels": True, "decode_graph_pieces": 3,
              "decode_graph_growth": 10.0, "compress_token_op": True},
    "passes": {},
    "warm": {},
}

# module constants a variant sets while it compiles and captures (its CUDA graphs keep the kernels the ops picked
# then): launch rules measured side by side before they become defaults
TMA, ROUTED = "dsflash_compile.custom_ops.bf16_linear_tma_triton", "dsflash_compile.custom_ops.routed_experts_triton"
GEMV, MHC = "dsflash_compile.custom_ops.bf16_linear_gemv_triton", "dsflash_compile.custom_ops.mhc_triton"
KV, TOPK = "dsflash_compile.custom_ops.kv_norm_rope_triton", "dsflash_compile.custom_ops.topk_triton"
ATTENTION = "dsflash_compile.custom_ops.attention_triton"
COMPRESS = "dsflash_compile.custom_ops.compress_token_triton"
KERNEL_SETTINGS = {"tiled-big-linear": {TMA: {"MIN_K": 1 << 30}},
                   "shared-first": {ROUTED: {"SHARED_FIRST": True}},
                   "shared-first-128": {ROUTED: {"SHARED_FIRST": True, "UP_MAXNREG": 128}},
                   "up-regs-128": {ROUTED: {"UP_MAXNREG": 128}},
                   "down-16": {ROUTED: {"DOWN_BLOCK_N": 16}},
                   "tma-prefetch": {TMA: {"PREFETCH_STAGES": 1, "PREFETCH_MIN_K": 0}},
                   "tma-prefetch-2": {TMA: {"PREFETCH_STAGES": 2, "PREFETCH_MIN_K": 0}},
                   "no-prefetch": {TMA: {"PREFETCH_STAGES": 0}},
                   "prefetch-wo-b-2": {TMA: {"PREFETCH_STAGES": 2}},
                   "gemv-at-once": {GEMV: {"AT_ONCE": True}},
                   "seam-norm-at-once": {GEMV: {"AT_ONCE": True}},
                   "seam-late-loads": {MHC: {"EARLY_FN": False, "ROW_LOADS_FIRST": False}},
                   "kv-rot-first": {KV: {"ROT_FIRST": True}},
                   "loads-first": {GEMV: {"AT_ONCE": True}, KV: {"ROT_FIRST": True}},
                   "single-topk": {TOPK: {"SINGLE_ON": True}},
                   "e-all": {TOPK: {"SINGLE_ON": True}},
                   "e-early": {TOPK: {"SINGLE_ON": True}},
                   "e-early-prefetch": {TOPK: {"SINGLE_ON": True}, ATTENTION: {"PREFETCH_KEYS": True}},
                   "e-early-no-engram": {TOPK: {"SINGLE_ON": True}},
                   "no-single-topk": {TOPK: {"SINGLE_ON": False}},
                   "before-f1": {TOPK: {"SINGLE_ON": False}},
                   "topk-8-warps": {TOPK: {"SINGLE_MAX_WARPS": 8}},
                   "before-g": {TOPK: {"SINGLE_MAX_WARPS": 16}},
                   "g-all": {TOPK: {"SINGLE_MAX_WARPS": 8}, ATTENTION: {"PREFETCH_KEYS": True}},
                   "g-all-kv-first": {TOPK: {"SINGLE_MAX_WARPS": 8}, ATTENTION: {"PREFETCH_KEYS": True}},
                   "rope-cos-sin": {"dsflash_compile.rope": {"COS_SIN": True}},
                   "setup-combo-cos-sin": {"dsflash_compile.rope": {"COS_SIN": True}},
                   "single-split": {TOPK: {"SINGLE_SPLIT": True}},
                   "before-k": {TOPK: {"SINGLE_SPLIT": False}},
                   "h-all": {TOPK: {"SINGLE_SPLIT": True}},
                   "i-all": {TOPK: {"SINGLE_SPLIT": True}},
                   "single-split-radix": {TOPK: {"SINGLE_SPLIT": True, "SINGLE_RADIX": True}},
                   "compress-op-no-prefetch": {COMPRESS: {"PREFETCH": False}},
                   "attention-prefetch": {ATTENTION: {"PREFETCH_KEYS": True}},
                   "attention-prefetch-kv-first": {ATTENTION: {"PREFETCH_KEYS": True}}}


@contextmanager
def kernel_settings(settings: dict):
    """Set {module name: {constant: value}} for the block, then restore the values."""
    saved = []
    for name, values in settings.items():
        module = importlib.import_module(name)
        for constant, value in values.items():
            saved.append((module, constant, getattr(module, constant)))
            setattr(module, constant, value)
    try:
        yield
    finally:
        for module, constant, value in reversed(saved):
            setattr(module, constant, value)


def fill_cache(cache, batch: int, context: int, gen: torch.Generator) -> None:
    """Every row of the first `batch` holds `context` tokens of random (finite, on-grid) records."""
    def fill(storage: dict, fmt: str, dim: int, rows: int):
        for t in storage.values():
            values = torch.randn(batch, rows, dim, generator=gen, device=t.device).bfloat16()
            t[:batch, :rows] = values if fmt == "bf16" else records.encode_reference(values, fmt)

    text = cache.config
    fill(cache.window, cache.window_format, text.head_dim, cache.window_size)
    for layer, t in cache.compressed.items():
        ratio = text.layer_roles[layer].ratio
        fill({layer: t}, cache.compressed_format, text.head_dim, context // ratio)
        fill({layer: cache.index_keys[layer]}, cache.index_format, text.index_head_dim, context // ratio)
    cache.lengths[:batch] = context
    cache.seen_columns = context


def compare_logits(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """Equality and max |difference|; beside them the reference's largest |logit| (its scale) and the share of
    rows with the same top token."""
    return {"equal": torch.equal(logits, reference), "max_abs": (logits - reference).abs().max().item(),
            "first_max_abs": reference.abs().max().item(),
            "same_argmax": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()}


def step_time(step, steps: int) -> float:
    """Median seconds per decode step over `steps` consecutive steps (host work included)."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def decode_step(runner, ids: torch.Tensor, mask: torch.Tensor, context: int):
    """A decode step of `runner` for these rows; the cache is rewound to `context` tokens before it fills
    (every step then costs the same). Every row is rewound: the steps of another batch size advanced rows
    this one does not hold."""
    def step():
        if runner.cache.seen_columns >= runner.cache.max_length - 1:
            runner.cache.lengths.fill_(context)
            runner.cache.seen_columns = context
        return runner(ids, mask, 1)
    return step


def profile_step(step, trace_path: str | None = None, top: int = 0) -> dict:
    """Kernels launched by one step (after an unprofiled one) and optionally the top kernels by device time."""
    step()
    torch.cuda.synchronize()
    return profile_summary(step, trace_path, top)


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a @ a
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    end.synchronize()
    return 10 * 2 * 8192 ** 3 / (start.elapsed_time(end) / 1e3)


def floor(model, batch: int, context: int, bandwidth: float, flops_rate: float) -> dict:
    """Bytes that must move in one decode step and its FLOPs (benchmarking.decode_traffic says which) over the
    measured rates: the larger time is the floor."""
    traffic = decode_traffic(model, batch, context)
    cache_bytes = traffic["bytes"]["attention"] + traffic["bytes"]["indexer"]
    weight_bytes = sum(traffic["bytes"].values()) - cache_bytes
    return {"weight_bytes": weight_bytes, "cache_bytes": cache_bytes, "flops": traffic["flops"],
            "bandwidth": bandwidth, "matmul_flops_per_s": flops_rate,
            "floor_s": max((weight_bytes + cache_bytes) / bandwidth, traffic["flops"] / flops_rate)}


def main() -> None:
    # a cold Inductor cache (Inductor reads the variable when it compiles); here, not at import: bench_overlap
    # and bench_parallel import this module's helpers
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="dsflash-inductor-"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="flash-40l-e8")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20, help="consecutive steps per timing (their median)")
    parser.add_argument("--rounds", type=int, default=5, help="timings per compiled variant, taken in turns")
    parser.add_argument("--variants", default="day-zero,no-passes,passes",
                        help="of day-zero, " + ", ".join(f"{k} ({v})" for k, v in VARIANTS.items() if k != "warm"))
    parser.add_argument("--layers", type=int, help="override num_hidden_layers (keeps the preset's schedule prefix)")
    parser.add_argument("--weights", choices=["native", "bf16"], default="bf16",
                        help="FP8/MXFP4 projections kept as stored (native) or dequantized to bf16")
    parser.add_argument("--eager-logits", action="store_true",
                        help="also compare every compiled variant's logits with the model's own uncompiled forward "
                             "(the same ops, formats and MoE layout, no Inductor; after the last variant's compile)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    args.batch = sorted(set(args.batch))
    # the batches in the name: runs of other batches into one --out keep their own summaries
    summary = f"compile-profile-{args.preset}-" + "-".join(f"b{batch}" for batch in args.batch)
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds ({args.rounds}) and --steps ({args.steps}) must be >= 1")
    variants = args.variants.split(",")
    unknown = set(variants) - ({"day-zero", *VARIANTS} - {"warm"})
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)} (warm runs with passes)")

    overrides = {"weights": args.weights}
    if args.layers:
        base = preset_config(args.preset).text_config
        overrides |= {"num_hidden_layers": args.layers, "compress_ratios": base.compress_ratios[:args.layers]}
    config = preset_config(args.preset, **overrides)
    start = time.perf_counter()
    with torch.device("cuda"):
        model = DeepseekV41ForCausalLM(config).eval()
    result = {**run_metadata(), "preset": args.preset, "overrides": overrides, "context": args.context,
              "build_s": time.perf_counter() - start, "model_bytes_on_gpu": torch.cuda.memory_allocated(),
              "batches": {}}
    print(f"{args.preset} with {args.weights} weights: {result['model_bytes_on_gpu'] / 2 ** 30:.2f} GiB on the GPU",
          flush=True)
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    max_batch, max_length = max(args.batch), args.context + 4 * args.steps + 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.set_grad_enabled(False)

    inputs = {}
    for batch in args.batch:
        ids = torch.randint(0, config.text_config.vocab_size, (batch, 1), device="cuda", generator=gen)
        inputs[batch] = (ids, torch.ones_like(ids))
    rows = {batch: result["batches"].setdefault(str(batch), {}) for batch in args.batch}

    if "day-zero" in variants:
        for layer in model.model.layers:
            layer.ffn.grouped = False  # the reference MoE loop (compile() stacks the experts later)
        for batch, (ids, mask) in inputs.items():
            cache = model.new_cache(batch, max_length, window_format="bf16", compressed_format="bf16",
                                    index_format="bf16")
            fill_cache(cache, batch, args.context, gen)
            with reference_kernels():
                def eager_step():
                    return model(ids, mask, cache=cache, logits_to_keep=1).logits
                rows[batch]["day_zero_s"] = step_time(eager_step, max(3, args.steps // 4))
                rows[batch]["day_zero_profile"] = profile_step(eager_step)
            print(f"day-zero batch {batch}: {rows[batch]['day_zero_s'] * 1e6:.0f} us per step", flush=True)
            save_results(result, summary, args.out)
            del cache

    # each variant is compiled, captured and profiled in turn, and kept: its decode graphs read the model's
    # tensors by address, so the tensors of every layout a variant captured (the experts stacked with or
    # without the shared one) stay alive beside the runner. Each change of layout keeps one more copy of
    # the routed experts (most of the model's bytes). The batches fill in ascending order, so every
    # row of the largest holds --context tokens when the rounds time them all.
    steps, alive = {}, []  # variant -> batch -> its decode step; the tensors its graphs read
    all_logits = {batch: {} for batch in args.batch}  # batch -> variant -> its third step's logits, in run order
    for variant in [v for v in VARIANTS if v in variants or (v == "warm" and "passes" in variants)]:
        with kernel_settings(KERNEL_SETTINGS.get(variant, {})):
            key = variant.replace("-", "_")
            try:  # a variant that fails (an op's kernel on a GPU first seen here) must not lose the others' numbers
                torch._dynamo.reset()
                counters.clear()
                model.compiled_runner = None
                dsflash_compile.compile(model, max_batch=max_batch, max_length=max_length,
                                        batch_buckets=tuple(args.batch), **VARIANTS[variant])
                runner = model.compiled_runner
                for batch, (ids, mask) in inputs.items():
                    row = rows[batch]
                    runner.cache.reset()
                    # the same cache for every variant, so their logits compare
                    fill_cache(runner.cache, batch, args.context, torch.Generator(device="cuda").manual_seed(batch))
                    compiled_step = decode_step(runner, ids, mask, args.context)
                    if variant != "warm":
                        steps.setdefault(key, {})[batch] = compiled_step
                    start = time.perf_counter()
                    for _ in range(3):  # compile, record the CUDA graph, first replay
                        logits = compiled_step()
                    torch.cuda.synchronize()
                    row[f"{key}_compile_s"] = time.perf_counter() - start
                    print(f"{variant} batch {batch}: first three calls (compile + capture) "
                          f"{row[f'{key}_compile_s']:.1f} s", flush=True)
                    if variant == "warm":
                        continue
                    all_logits[batch][key] = logits[:batch].clone()
                    first, first_logits = next(iter(all_logits[batch].items()))
                    row[f"{key}_logits_vs_{first}"] = compare_logits(logits[:batch], first_logits)
                    graphs = counters["stats"]["unique_graphs"]
                    step_time(compiled_step, args.steps)  # steps after warm-up for the recompiles; the rounds time them
                    # every variant's trace (the passes' without a suffix): two compiles' kernels side by side
                    suffix = "" if variant == "passes" else f"-{variant}"
                    trace = os.path.join(args.out, f"decode-trace-{args.preset}-b{batch}{suffix}.json")
                    row[f"{key}_profile"] = profile_step(compiled_step, trace, top=15 if variant == "passes" else 0)
                    row[f"{key}_recompiles_after_warmup"] = counters["stats"]["unique_graphs"] - graphs
                    row[f"{key}_graph_breaks"] = sum(counters["graph_break"].values())
                    if runner.pass_manager is not None:
                        # a variant compiled after another with the same passes can hit Inductor's FX graph cache:
                        # its passes do not run again and count 0, so pass_matches keeps the largest count (a cold
                        # compile's)
                        matches = dict(runner.pass_manager.matches)
                        row[f"{key}_pass_matches"] = matches
                        if sum(matches.values()) >= sum(row.get("pass_matches", {}).values()):
                            row["pass_matches"] = matches
                    print(f"{variant} batch {batch}: {row[f'{key}_profile']['kernels']} kernels, "
                          f"{row[f'{key}_profile']['device_us']:.0f} us of kernel time", flush=True)
                    save_results(result, summary, args.out)  # partial results survive a timeout
            except Exception as error:  # noqa: BLE001 - recorded against the variant, the run goes on
                traceback.print_exc()
                steps.pop(key, None)
                for batch in inputs:
                    all_logits[batch].pop(key, None)
                    rows[batch][f"{key}_error"] = f"{type(error).__name__}: {error}"
                print(f"{variant}: failed ({type(error).__name__}: {error}); the other variants go on", flush=True)
                save_results(result, summary, args.out)
                continue
        alive.append([*model.parameters(), *model.buffers()])

    if args.eager_logits and model.compiled_runner is not None:
        # the uncompiled forward (a cache not the runner's runs the blocks under force_eager) on a cache filled
        # alike (the runner's formats), three steps as the variants took; on the ops' kernels as the last variant
        # set them (q's RoPE: dsflash::rope_ and apply_rope give the same bits on the H200)
        runner = model.compiled_runner
        for batch, (ids, mask) in inputs.items():
            cache = model.new_cache(batch, max_length, window_format=runner.cache.window_format,
                                    compressed_format=runner.cache.compressed_format,
                                    index_format=runner.cache.index_format)
            fill_cache(cache, batch, args.context, torch.Generator(device="cuda").manual_seed(batch))
            for _ in range(3):
                eager = model(ids, mask, cache=cache, logits_to_keep=1).logits
            for key, logits in all_logits[batch].items():
                rows[batch][f"{key}_logits_vs_eager"] = compare_logits(logits, eager[:batch].to(logits.dtype))
            del cache

    # step times: every variant in each of --rounds rounds, the order rotating per round, so a slower stretch
    # of the machine (or whatever follows a compile) hits each alike; per variant the median over rounds
    names = list(steps)
    for round_ in range(args.rounds if names else 0):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for key in order:
            for batch, step in steps[key].items():
                rows[batch].setdefault(f"{key}_s_rounds", []).append(step_time(step, args.steps))
                rows[batch].setdefault(f"{key}_back_to_back_s_rounds", []).append(time_eager(step, args.steps))
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    for batch, row in rows.items():
        for key in names:
            runs = row[f"{key}_s_rounds"]
            row[f"{key}_s"] = statistics.median(runs)
            row[f"{key}_back_to_back_s"] = statistics.median(row[f"{key}_back_to_back_s_rounds"])
            print(f"{key} batch {batch}: {row[f'{key}_s'] * 1e6:.0f} us per step "
                  f"({min(runs) * 1e6:.0f}-{max(runs) * 1e6:.0f} over {len(runs)} rounds); launched back to back "
                  f"{row[f'{key}_back_to_back_s'] * 1e6:.0f} us")

    for batch, row in rows.items():
        row["floor"] = floor(model, batch, args.context, bandwidth, rate)
        fl = row["floor"]["floor_s"]
        times = {k: round(v * 1e6, 1) for k, v in row.items() if k.endswith("_s") and "compile" not in k}
        print(f"batch {batch}: step us {times}  floor {fl * 1e6:.1f} us  "
              f"compile s { {k: round(v, 1) for k, v in row.items() if 'compile_s' in k} }")
        for k in ["day_zero_profile"] + [f"{v.replace('-', '_')}_profile" for v in VARIANTS]:
            if k in row:
                print(f"  {k}: {row[k]['kernels']} kernels, {row[k]['device_us']:.0f} us device time")
        print("  logits against the first variant's (and eager):", {k: v for k, v in row.items() if "_logits_vs_" in k})
        print(f"  pass matches {row.get('pass_matches')}, graph breaks {row.get('passes_graph_breaks')}, "
              f"recompiles after warm-up {row.get('passes_recompiles_after_warmup')}")
        for t in row.get("passes_profile", {}).get("top", []):
            print(f"    {t['total_us']:9.1f} us {t['calls']:5d}x {t['name']}")
    save_results(result, summary, args.out)


if __name__ == "__main__":
    main()
