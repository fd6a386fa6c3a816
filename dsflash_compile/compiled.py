"""`dsflash_compile.compile(model)`: the compiled fast path, behind the same model and `generate()`.

    model = dsflash_compile.compile(model, max_batch=8, max_length=4096)
    model.generate(input_ids, max_new_tokens=256)        # compiled graphs, transparently

What it sets up (SYSTEM.md, the compiler):
  - our FX passes in Inductor (`passes.install`) and the routed experts stacked for grouped GEMMs (no
    host syncs in the MoE); in graphs of at most `mhc_overlap_max_tokens` tokens (decode) each mHC seam's
    mixes can run on a side CUDA stream beside the next sublayer (passes/mhc_overlap.py; mhc_overlap=True);
  - regional compilation: every decoder block (with compile_engram every Engram module, with compile_setup the
    per-forward set-up) is compiled
    (fullgraph; static shapes unless dynamic_shapes). Blocks get their cache tensors as arguments
    (cache.LayerCache), so all layers of one role share one compiled graph per shape: compile time grows
    with the number of roles (about six), not of layers (40);
  - one static cache (max_batch x max_length) with fixed tensor addresses, reset in place by every
    generate() call;
  - decode (one new column per row): the whole step (set-up, 40 compiled blocks, head) captured as ONE
    CUDA graph per batch bucket, so a generated token is one graph replay; rows are padded to the bucket
    with inert all-padding rows. (mode="reduce-overhead" would capture each compiled region as its own
    graph; capturing the step ourselves gives the single replay.)
  - prefill chunks run the compiled blocks per (batch bucket, length bucket): a chunk is left-padded to its
    bucket (padding columns are inert); longer prompts run in chunks of the largest bucket, the remainder
    first, split where padding would cost more than another chunk (chunk_plan), so a new prompt length never
    compiles anew. A chunk of at most `prefill_graph_tokens` tokens (1024 by default: short chunks are
    host-bound) replays one CUDA graph of the whole chunk; otherwise the blocks are launched one by one, and
    with bounded replay the last chunk's trimmed layers (after the last KV source, on [B, window] columns)
    replay one CUDA graph per batch bucket (trimmed_graphs.py).
Inside, shapes are static: score rows span the cache's max_length (context.build_context says why that
changes no output).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import passes
from .cache import CacheCapacityError
from .context import check_left_padding
from .custom_ops.bf16_linear import MAX_ROWS as LINEAR_MAX_ROWS
from .custom_ops.bf16_linear import TALL_MIN_K as LINEAR_TALL_MIN_K
from .custom_ops.bf16_linear import TALL_MIN_ROWS as LINEAR_TALL_MIN_ROWS
from .custom_ops.mhc import ROUTE_MAX_EXPERTS, ROWS_MIN_TOKENS
from .custom_ops.mhc_deferred import DEFER_MAX_TOKENS
from .custom_ops.pdl import launches
from .custom_ops.routed_experts import MAX_TOKENS as ROUTED_MAX_TOKENS
from .layers import Linear, QuantLinear
from .moe import COUNT_ORDER_BOUND
from .piecewise_graph import PiecewiseGraph, piece_sizes
from .trimmed_graphs import TrimmedGraphs


@dataclass(frozen=True)
class CompileOptions:
    max_batch: int = 8
    max_length: int = 4096
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # capped at max_batch (which is added)
    prefill_buckets: tuple[int, ...] = (16, 64, 256, 1024, 4096)  # chunk lengths; longer prompts are chunked
    passes: bool = True  # our FX passes (mHC seam and router fusion)
    # issue 8: seams of at most this many tokens (batch x columns) run their mixes on a side CUDA stream beside
    # the next sublayer (passes/mhc_overlap.py), joined before the next seam; same bits as one launch per seam.
    # Off: on the H200 it paid at no decode batch measured. flash-40l-e8, fused / overlap step time 0.992, 0.988,
    # 0.982, 0.981, 0.978 at batch 1, 4, 8, 16, 32: split seams cost 0.2-0.7 ms a step over fused ones, and
    # running their mixes beside the next sublayer (0.81-0.94 ms of seam kernels concurrent) wins back at most
    # 0.2 ms (overlap-flash-40l-e8-b*-2026-11-30*.json, scripts/bench_overlap.py)
    mhc_overlap: bool = False
    mhc_overlap_max_tokens: int = 16  # below custom_ops.mhc.ROWS_MIN_TOKENS (checked)
    # issue 5: each seam of at most custom_ops.mhc_deferred.DEFER_MAX_TOKENS tokens (decode) leaves its mixes as
    # partials, finished by a kernel placed before their first reader (one sublayer later) that computes them
    # while the sublayer's last kernel runs (passes/mhc_defer.py): the seam's path ends after its collapse. H200,
    # B1 side by side (12-03 x3): 10.54 ms against 10.75, logits bit-equal (compile_and_profile --variants
    # passes,fused-mixes)
    mhc_defer_mixes: bool = True
    # issue 5: with mhc_defer_mixes, a router of at most mhc.ROUTE_MAX_EXPERTS experts runs inside the FFN's
    # deferred seam, in the program that norms its row (passes/router_seam.py), instead of its own launch (the
    # 8-expert router took 5.8 us of the H200 B1 step's path a layer, 12-03 y1). Off: it did not pay. H200, B1 side
    # by side (12-03 z4): 10.47 ms against 10.40 (837 kernels against 877): the one program's 80 KB of gate tiles
    # made the seam 14.0 us of the path against 5.4 + 6.0 for seam and router
    router_in_seam: bool = False
    # issue 5: the query's RoPE in wq_b's epilogue (passes/linear_rope.py, bf16_linear's `rot`) where wq_b runs
    # dsflash::bf16_linear or bf16_gemv (decode), instead of dsflash::rope_'s own launch (0.9 us of the B1 step's path
    # a layer). On the tiled kernel (12-03 a3, 12-04 b1) it did not pay: one row of wq_b moved off the TMA kernel.
    # With the TMA kernel's epilogue, H200, B1 side by side (12-04 d4, compile_and_profile --variants
    # passes,linear-rope, 7 rounds): 10.153 ms against 10.186 (6 of 7 rounds lower), logits bit-equal; wq_b + RoPE
    # 22.0 us of a layer's path against 21.7 + 0.9
    linear_rope: bool = True
    # issue 5: a one-row GEMV whose only reader multiplies it by a constant (the indexer's weights_proj(x) times
    # head_dim^-1/2 heads^-1/2) takes the constant in its epilogue, rounding as the multiply does
    # (passes/linear_scale.py): the same bits, one kernel less an index layer. On (same bits; not timed yet: no GPU
    # on 12-05 f)
    linear_scale: bool = True
    # issue 5: the query's RMSNorm in wq_b's kernel (passes/linear_norm.py: bf16_gemv's norm, the TMA kernel's NORM
    # prologue) where wq_b is its only reader, instead of Inductor's reduction kernel (1.2 us of the H200 B1 step's
    # path a layer, 12-04 d4). Off: slower. H200, B1 side by side (12-04 d5, 5 rounds): 10.237 ms against 10.084
    # (each round higher), logits bit-equal; wq_b 27.7 us of a layer's path against 1.2 + 21.5: the prologue's sum of
    # squares then looped over 10 tiles, one round trip each. Since, one load of the whole row: 12-05 g2 back to
    # back 9.973 ms against 9.993 (each round lower), but qkv_norm_op (the same norm in the ring write's launch,
    # on) 9.950: off (with qkv_norm_op on there is no Inductor norm before wq_b left to fold)
    linear_norm: bool = False
    # issue 5: with mhc_defer_mixes, a deferred seam whose normed row only the one-row GEMV of wq_a + wkv reads leaves
    # its RMSNorm to that GEMV's programs, which load the whole row anyway (passes/seam_norm_gemv.py): the seam then
    # takes no counter and no program finishes it (its path 7.3 us a layer at B1 on the H200, 12-03 a3). Off: no
    # clear gain. H200, B1 side by side (12-04 b1): 10.330 ms against 10.343, rounds overlapping; the seam 5.0 us of
    # a layer's path against 7.8, the GEMV, each program summing the row's squares, 9.6 against 7.2
    seam_norm_gemv: bool = False
    # issue 5: dsflash::kv_norm_rope reads and computes before its PDL wait where a kernel computed from its
    # inputs' producers runs between them (passes/early_reads.py). Off: it did not pay. H200, B1 side by side
    # (12-03 y1, compile_and_profile --variants passes,early-reads): 10.53 ms against 10.50 without, logits
    # bit-equal; the row's kernel 1.5 us of the path a layer either way
    early_reads: bool = False
    # issue 5: one-row projections (dsflash::bf16_gemv, fp32_gemv) read x and their weight and take their sums before
    # their PDL wait, beside the projection before them that streams a weight (passes/early_reads.py): the indexer's
    # wq_b beside the attention's (7.6 us of an index layer's path after it, 12-04 d5 trace), its weights_proj and
    # the compressors' projections beside wq_a + wkv. On: H200 B1 step (12-05 f1) 10.347 ms against 10.389 without,
    # each of 5 rounds lower, logits bit-equal (the indexer's wq_b 0.4 us of an index layer's path after wq_b against
    # 7.2; alone after wq_b 2.50 us against 6.67), measured before a clash with linear_rope was fixed (the early
    # pass now runs after the folds); variant no-early-gemv
    early_gemv: bool = True
    # issue 5: the attention's key row (kv_norm_rope) made before the query's wq_b, so that the attention's kernel
    # follows wq_b's (passes/kv_first.py; with attention_triton.PREFETCH_KEYS its programs prefetch their key records
    # in wq_b's tail). Off: not measured yet (12-05 f: no GPU)
    kv_first: bool = False
    # issue 5: grouped GEMMs of the bf16 routed experts with at most this many (token, slot) rows run
    # dsflash::grouped_mm (each picked expert's weight streamed about once, its row tiles as tall as the rows per
    # expert: mxfp4_experts_triton.bf16_launch) instead of torch._grouped_mm, whose CUTLASS grouped GEMM took 63
    # us per projection at decode batch 1 (2.3 TB/s: 6 picked experts, 142 MB) and ~80 at batch 64 (B64 trace,
    # 12-02 m). 448 rows = batch 64 at top-6 + the shared expert's row; H200 sweep (12-02 n, flash-40l-e8 stacks):
    # 1.4-1.6x torch._grouped_mm at 16, 32 and 64 tokens (scripts/sweep_experts.py --tall)
    moe_few_rows: int = 448
    # issue 5: bf16 routed experts of at most this many tokens run dsflash::routed_experts: no sort of the pairs,
    # gate/up/SwiGLU/weights/FP8 of h in one launch, the down projection and each token's ordered sum in another
    # (a third launch until 12-02 o), where the sorted path took ~15 small kernels around its three grouped GEMMs
    # per layer. H200, flash-40l-e8 bf16, decode step against the sorted path (12-01 j, rounds in one run): B1
    # 13.73 / 14.61 ms, B8 16.00 / 17.63, B16 17.80 / 18.95, but B64 37.80 / 24.39 (its 64-row tiles: ~10x the
    # GEMMs' time). A shape test: with dynamic shapes it guards a graph on its token count. At most the kernels'
    # MAX_TOKENS (64)
    moe_few_tokens: int = 16
    # issue 5: the routed pairs sorted by expert by counting (MoE._expert_order) where pairs x (groups + 1) is
    # at most this (any decode batch up to 64 and 1.5K-token prefill chunks of the release), and each token's
    # slots by counting at every size (MoE._slot_order); 0: both argsort. Same bits. Inductor turned the pairs'
    # argsort into one single-program kernel (39 us per layer at B64); counting: decode step 23.8 ms against
    # 26.4 at B64 (H200, flash-40l-e8 bf16, 11-30, compile-profile-flash-40l-e8-b64-count-moe-2026-11-30.json)
    moe_count_order: int = COUNT_ORDER_BOUND
    # issue 5: with moe_count_order, the pairs' order, its inverse, the GEMMs' offsets and the slots' order as
    # dsflash::expert_order (one launch) where its kernel fits (custom_ops/expert_order.py: flash-40l-e8 decode
    # up to batch 146; not the release's 384 experts), instead of the ~12 small Inductor kernels of the counting
    # code. Same bits. H200, flash-40l-e8 bf16, B64 decode step 18.40 ms against 19.13 without, 1489 kernels
    # against 1889, logits equal (12-02 q, compile-profile-flash-40l-e8-b64-order-op-2026-12-02-q.json)
    moe_order_op: bool = True
    # issue 5: the sorted path's gather of x, w1 and w3 grouped GEMMs, clamps, SwiGLU, routing weight and FP8 of h
    # as dsflash::grouped_swiglu (one launch) wherever its GEMMs run dsflash::grouped_mm (up to moe_few_rows
    # pairs, static shapes), where Inductor ran a gather, two grouped GEMMs and an epilogue kernel (H200 B64 trace,
    # 12-02 p: 2.8 + 58 + 58 + 4.9-8.8 us a layer)
    moe_swiglu_op: bool = True
    # issue 5: the sorted path's per-token sum of the down GEMM's rows (gather, ordered fp32 sum, cast) as
    # dsflash::token_sum (one launch), where Inductor ran two kernels (H200 B64 trace, 12-02 s: 4.4 + 5.2 us a layer,
    # the second fused with the block's closing hc_post, which then ran alone: since 12-03 v the next block's first
    # seam does it, mhc.PendingPost). Same bits. H200, flash-40l-e8 bf16,
    # B64 decode side by side (12-02 t): 16.75 ms against 16.79
    moe_token_sum_op: bool = True
    # issue 5: the query heads' RoPE as dsflash::rope_, in place on wq_b's output: written functionally (a cat or
    # a slice_scatter) Inductor's kernel reads and writes all of q's columns, 64 of 512 of which rotate (H200 B64
    # trace, 12-02 q/r: 6.7-6.8 us a layer; the op 1.6, 1.2 at B1 as Inductor's). H200 side by side (12-02 r): B64
    # 18.29 ms against 18.44, B1 11.34 against 11.35 (compile-profile-flash-40l-e8-b1-b64-rope-op-vs-inductor-
    # 2026-12-02-r.json). The op's bits equal Inductor's RoPE there, yet the two compiles' logits differ (B64 3.98
    # apart, same top token in 67% of rows; B1 0.08): from their other kernels, not yet pinned (the session note)
    q_rope_op: bool = True
    # issue 5: the query's RMSNorm in dsflash::kv_norm_rope's launch (dsflash::qkv_norm_rope, a program a row of
    # each) where the layer's queries are not trimmed, instead of its own Inductor kernel (1.2 us of the B1 step's
    # path a layer). Slower on 12-03 a2 (10.56 ms against 10.44: the attention merge's path grew from 2.1 to 7.3 us
    # a layer), but with the ring write in the same launch (decode_ring_write_op, on since 12-05 f1) faster: H200, B1
    # side by side (12-05 g2, variant joint-ring): steps launched back to back 9.950 ms against 9.993 (each of 5
    # rounds lower), waited for 10.114 against 10.196; 678 kernels against 718, logits bit-equal. On
    qkv_norm_op: bool = True
    # issue 5: one-token steps make each layer's key row (kv_norm_rope's) in the attention's launch, before its PDL
    # wait, and write the ring there (dsflash::attention_own_key_), where qkv_norm_rope's launch, 2.1 us of every
    # layer's path in the H200's B1 step (12-05 g3 trace), sat between the input projection and wq_b. The query's
    # norm is then an Inductor kernel, or with linear_norm wq_b's prologue where wq_b is its only reader (qkv_norm_op
    # has nothing to join). Same bits as the two launches (interpreter). Off: slower. H100, B1 side by side with
    # linear_norm (12-05 k1, variant own-key): 12974 us waited against 12949, back to back 12938 against 12898, 612
    # kernels against 644, logits 2.85 of 6.47 off the defaults' (another argmax; its CUDA tests not run yet)
    attention_own_key: bool = False
    # issue 5: one-token steps run each KV source's compressor after its projection as one launch
    # (dsflash::compress_token_: the pooling, norm, the index keys' projection, norm, RoPE and record, the compressed
    # row's RoPE and record, one program a batch row), where seven kernels of a few programs each took 14.4 us of the
    # H200's B1 step path in each of the 4 KV sources (12-05 g3 trace, layer 2). Records within the keys' projection's
    # summation order of the split path. H200 (12-05 j1, compile_and_profile.py compress-op against passes): B1 step
    # 9943 us waited against 10008, back to back 9885 against 9941, lower in all 5 rounds, logits bit-equal
    compress_token_op: bool = True
    # issue 5: one-token steps (decode) write each layer's window ring in kv_norm_rope's launch
    # (dsflash::kv_norm_rope_write_, before the attention: the slot the token goes to holds no key of its window),
    # where the ring write's own launch took 1.0-1.1 us of every layer's path in the H200's B1 step (12-04 d5); with
    # qkv_norm_op, in qkv_norm_rope's launch (dsflash::qkv_norm_rope_write_).
    # On: H200 B1 step (12-05 f1, with compressor_gemv, single top-k and engram-op as variant e-all) 10.212 ms against
    # 10.389 without the four, each of 5 rounds lower, logits bit-equal (variant no-ring-write: without it)
    decode_ring_write_op: bool = True
    # issue 5: the indexer's query RoPE + FP4 QDQ as dsflash::rope_fp4_qdq_ and its keys' RoPE as dsflash::rope_, in
    # place: compiled functionally they were one Inductor persistent reduction whose launch the runtime autotuner
    # picks anew each compile, some picks serial (H200 traces, 12-02 s: the query 24 us at B1 in one compile, 6.2 in
    # another, 20.7 at B64, in each of the 9 index layers)
    index_rope_op: bool = True
    # (H200, 12-02 r: the w2 GEMM with each token's ordered sum in one launch, dsflash::grouped_token_sum, was
    # 18.21 ms a B64 step against 18.03 with Inductor's two kernels after the GEMM; dropped)
    # issue 5: bf16 weights: the shared expert as one more slice of the routed stacks (every token's last pair,
    # weight 1: the same bits), so its three GEMVs and two split-K reduces per layer (28 us at B1 on the H200,
    # floor 17) ride in the grouped GEMMs. No effect on native weights (FP8 shared, MXFP4 routed) or ParallelMoE
    moe_shared_stacked: bool = True
    # issue 5: each attention's wq_a and wkv (same quantized input) as one projection: one GEMV instead of two at
    # decode (H200 B1: 5.8 + 1.7 reduce and 5.1 + 1.7 us, floor together 4.4); tensors shared, checkpoint unchanged
    fuse_input_projections: bool = True
    # issue 5: bf16 QuantLinear inputs of at most this many rows run dsflash::bf16_linear: the FP8 of the input,
    # the GEMV and its split-K sum in one Triton launch, where cuBLAS ran an Inductor FP8 kernel, its GEMV and a
    # split-K reduce. At one row the kernel is as fast as cuBLAS's GEMVs on the large projections and slower on
    # the small ones, and saves the kernels around them (H200 sweep, 12-01 l: custom_ops/bf16_linear_triton.py);
    # at 8 rows wq_b takes 28.3 us against 23.5, so the default is batch 1 only. 0: cuBLAS. At most MAX_ROWS (64)
    linear_few_rows: int = 1
    # issue 5: of those, one-row inputs run dsflash::bf16_gemv: one weight tile a program, loaded at once, for
    # weights of up to ~24 MB (wq_a+wkv; larger ones its CUDA kernel hands to bf16_linear's). H200 (12-03 u,
    # sweep_linear.py --after-seam): wq_a+wkv after an mHC seam 9.9 us against 12.5 with bf16_linear's kernel; the
    # B1 step 10.65 ms against 10.76 with it off (12-03 v, compile_and_profile variant tiled-linear)
    linear_gemv: bool = True
    # issue 5: one-row inputs of the unquantized bf16 projections (layers.Linear: the indexer's weights_proj and wk,
    # the ratio-1 compressor's wkv) run dsflash::bf16_gemv too, where cuBLAS ran a split-K GEMV and its reduce: in
    # the H200 B1 step's trace (12-03 y1) weights_proj (32 x 5120) took 4.7 + 1.4 us of the path at each of the 8
    # index sources
    plain_linear_gemv: bool = True
    # issue 5: the ratio > 1 compressors' fp32 wkv and wgate as one projection (Compressor.fuse_projections), one row
    # on dsflash::fp32_gemv (bf16_gemv's kernel, fp32 sums out), where cuBLAS ran two fp32 GEMVs of 6.4 us after an
    # Inductor kernel widening x in each ratio-2 source of the H200's B1 step (12-04 d5 trace; 16.8 MB: 4.0 us at the
    # floor). On: H200 B1 step with ring writes, single top-k and engram-op (12-05 f1, variant e-all) 10.212 ms
    # against 10.389 without the four, each of 5 rounds lower, logits bit-equal (variant no-compressor-gemv)
    compressor_gemv: bool = True
    # issue 5: bf16 inputs of 33-64 rows (decode batch 64) of the long-K projections (groups x K >= 8192: wo_a, wo_b)
    # run dsflash::fp8_qdq then dsflash::bf16_linear (QuantLinear.tall_rows), where cuBLAS took wo_a at 24.5 us
    # and wo_b at 29.3 with a split-K reduce kernel after it (H200 sweep at 64 rows, 12-02 q: 23.0 / 28.7 us). B64
    # step side by side (12-03 v, compile_and_profile variant cublas-tall): 16.68 ms against 16.82
    linear_tall: bool = True
    # issue 5: bf16 QuantLinear inputs of at most this many rows (on cuBLAS: above linear_few_rows) take their FP8
    # as dsflash::fp8_qdq, a fixed launch, instead of Inductor's persistent reduction, whose launch its runtime
    # autotuner picks anew each compile (H200 B64: 1.8 us a launch in one compile, 7.2-8.2 in others, 74 a step).
    # Same bits. H200, flash-40l-e8 bf16, B64 decode side by side (12-02 s): 17.31 ms against 17.49, logits equal
    qdq_op_rows: int = 64
    # issue 5: the Engram modules (outside the blocks: they run before their layer's block) compiled too; eager
    # they were ~53 small aten kernels each. H200, flash-40l-e8 bf16 (12-01, f65d7ae): 0 graph breaks; decode
    # B1 1924 kernels against 2018, 12.34 ms of kernel time against 12.48; a 1K prefill's kernel time 60.9 ms
    # against 62.3 with bounded replay, 92.4 against 94.3 without (prefill-1k-engram-2026-12-01-h.json)
    compile_engram: bool = True
    # issue 5: the Engram table's rows gathered and dequantized by dsflash::engram_lookup (one launch), where the
    # compiled Engram ran its UE8M0 scales' gather and widening as eager aten kernels (no Inductor code for
    # float8_e8m0fnu: an index of 3.5 us after an 8 us gap and a copy of 1.9 us at each Engram layer of the H200's
    # B1 step, 12-04 d5). Same bits. Its CUDA test over every code and scale byte failed on 12-05 f1: the kernels'
    # bf16 rounding turned the GPU's NaN into -0 (custom_ops/bf16_bits.py, fixed; passed on 12-05 g1). H200, B1 side
    # by side, logits bit-equal: 12-05 g1 (with a slower top-k launch) 10.033 ms against 10.044, back to back 9.976
    # against 9.996, each round lower; g2 back to back 9.988 against 9.993. On
    engram_lookup_op: bool = True
    # the per-forward set-up (DeepseekV41Model.begin: positions, window lists, RoPE, Engram hashes, embedding)
    # compiled too: eager it is ~360 host-launched ops before a prefill's first block, with the GPU waiting
    compile_setup: bool = True
    # issue 5: the set-up compiled with Inductor's combo kernels (its combo_kernels: independent kernels of different
    # sizes as one launch). In the H200's B1 step (12-05 g3 trace) the decode set-up is 21 one-program kernels, 32 us
    # before the first block's seam (positions, window lists, three rotations of 3 kernels each, Engram hashes, the
    # embedding): most read only the positions. H100, B1 side by side (12-05 k1): 12873 us waited against 12949,
    # back to back 12850 against 12898, every round lower, 630 kernels against 644. On. Inductor backend only
    setup_combo_kernels: bool = True
    # the forward's finish (DeepseekV41Model.collapse: the last block's streams collapsed and normed; advance: the
    # cache's lengths) compiled too: eager it was 18 aten kernels (~38 us) between the last block and the head in
    # the H200 B1 step's trace (12-03 y1)
    compile_finish: bool = True
    # CUDA graphs (CUDA only): the decode step as one graph per batch bucket, short prefill chunks as one each
    # (prefill_graph_tokens), the trimmed layers of longer ones (trimmed_graphs)
    cuda_graphs: bool = True
    # the decode step's graph as this many graphs replayed back to back (piecewise_graph.py): the GPU then waits
    # only for the first piece's cudaGraphLaunch, not the whole step's. 1: one graph, as with mhc_overlap (whose
    # side-stream forks join after the block boundaries the pieces are cut at)
    decode_graph_pieces: int = 7
    # the pieces' sizes in blocks grow by this factor (piecewise_graph.piece_sizes: flash's 40 blocks as 1, 2, 2,
    # 3, 5, 9, 18), so the GPU waits only for a one-block piece's launch; 1: even pieces. H200, flash-40l-e8 bf16
    # (12-02 s), against 4 even pieces side by side: B1 11.11 ms against 11.28, B64 17.77 against 18.10. 3 pieces
    # of 1, 4, 35 blocks (growth 10, variant pieces-3): H100 B1 (12-05 k1) 12941 us waited against 12949, rounds
    # overlapping: kept at 7
    decode_graph_growth: float = 2.0
    # with more than one piece, the step's set-up (embedding, Engram hashes, positions, rotations: ~18 small
    # kernels, ~28 us on the H200) as a piece of its own before the first block's: the GPU then waits only for
    # that piece's cudaGraphLaunch, and the first block's piece launches while the set-up runs
    decode_graph_setup_piece: bool = False
    # bounded replay's trimmed layers as CUDA graphs too (with cuda_graphs), in chunks longer than
    # prefill_graph_tokens (a shorter chunk's graph holds them)
    trimmed_graphs: bool = True
    # prefill chunks of at most this many tokens (rows x bucket length) replay one CUDA graph each (with
    # cuda_graphs; 0: none): such chunks are host-bound. H200 (16-core host, 12-01): a 1K prompt's prefill
    # launched block by block took 125-131 ms for 92 ms of kernels without bounded replay, 82-86 ms for 58
    # with it (prefill-1k-*-2026-12-01-h.json); as one graph 91.8 and 58.8 ms (prefill-1k-chunk-graphs-
    # 2026-12-01-i.json). Longer chunks keep the GPU busy on their own
    prefill_graph_tokens: int = 1024
    # programmatic dependent launch (sm_90+; custom_ops/pdl.py): the dsflash kernels the runner launches start
    # while the kernel before them finishes and wait for it on the GPU, hiding the launch gap between kernels.
    # H200, flash-40l-e8 bf16, with inductor_pdl, side by side against neither (12-02 s): B1 11.11 ms against
    # 11.59 and 11.25 against 11.51 in another run, B64 17.77 against 17.87; logits bit-equal
    pdl: bool = True
    # the same for Inductor's Triton kernels (its triton.enable_pdl, where this torch has it): B1 (12-02 s, with
    # the up kernel still started early) 11.10 ms with both, 11.23 with ours alone
    inductor_pdl: bool = True
    swa_bounded_replay: bool | None = None  # sets the model config's switch (None: keep the config's value)
    # automatic dynamic shapes for the blocks (torch.compile(dynamic=None)): the second size seen in a dimension
    # (batch bucket, prefill length) compiles one symbolic graph per role that every later size reuses, instead
    # of one static graph per size (tiny preset, 3 batch x 3 prefill buckets: 34 graphs instead of 66; on the
    # H200 a flash-40l-e8 graph takes seconds to compile). Off until the H200 shows those kernels as fast; its
    # first H200 run (serve bench, 11-30) failed in Inductor's coalesce tiling analysis, now off with it
    dynamic_shapes: bool = False
    backend: str = "inductor"  # torch.compile backend ("eager" / "aot_eager": quick graph checks in tests)

    def __post_init__(self):
        if self.max_batch < 1 or self.max_length < 1:
            raise ValueError(f"CompileOptions: max_batch ({self.max_batch}) and max_length ({self.max_length}) "
                             "must be >= 1")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"CompileOptions.prefill_graph_tokens={self.prefill_graph_tokens}: expected >= 0 (0: no "
                             "prefill chunk graphs)")
        if not 0 <= self.moe_few_tokens <= ROUTED_MAX_TOKENS:
            raise ValueError(f"CompileOptions.moe_few_tokens={self.moe_few_tokens}: expected 0 ... {ROUTED_MAX_TOKENS} "
                             "(dsflash::routed_experts' kernels take at most that many tokens)")
        if not 0 <= self.linear_few_rows <= LINEAR_MAX_ROWS:
            raise ValueError(f"CompileOptions.linear_few_rows={self.linear_few_rows}: expected 0 ... {LINEAR_MAX_ROWS} "
                             "(dsflash::bf16_linear's kernel takes at most that many rows)")
        if self.decode_graph_pieces < 1:
            raise ValueError(f"CompileOptions.decode_graph_pieces={self.decode_graph_pieces}: expected >= 1")
        if self.decode_graph_growth < 1:
            raise ValueError(f"CompileOptions.decode_graph_growth={self.decode_graph_growth}: expected >= 1 (pieces "
                             "that grow, or even ones)")
        if self.mhc_overlap_max_tokens < 1:
            raise ValueError(f"CompileOptions.mhc_overlap_max_tokens={self.mhc_overlap_max_tokens}: expected >= 1 "
                             "(mhc_overlap=False turns the overlap off)")
        if self.mhc_overlap and self.mhc_overlap_max_tokens >= ROWS_MIN_TOKENS:
            # the fused seam runs the rows kernel from there, which sums in another order than the split ops
            raise ValueError(f"CompileOptions.mhc_overlap_max_tokens={self.mhc_overlap_max_tokens}: the overlap "
                             f"splits seams of fewer than {ROWS_MIN_TOKENS} tokens (custom_ops/mhc.py ROWS_MIN_TOKENS)")
        for name in ("batch_buckets", "prefill_buckets"):
            buckets = getattr(self, name)
            if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
                raise ValueError(f"CompileOptions.{name}={buckets}: expected increasing positive sizes")


def _fresh(t: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous copy: the compiled set-up guards on strides, even a size-1 batch's (generate() passes
    column views of its sequence, and a prompt's chunks are column slices, whose stride is the whole length)."""
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


def _static(t: torch.Tensor | None) -> torch.Tensor | None:
    """A graph's static input: a fresh copy that is never an inference tensor, so later calls may copy into it
    with inference mode on or off."""
    with torch.inference_mode(False):
        return _fresh(t)


def _bucket(buckets, size: int) -> int:
    return buckets[bisect.bisect_left(buckets, size)]


# A prefill chunk's fixed cost in tokens of work: on the H200, flash-40l-e8 chunks took about 30 ms + 0.11 ms
# per token (prefill-2026-11-30.json: 145 ms at 1024, ~490 ms per 4096)
CHUNK_OVERHEAD_TOKENS = 256


def chunk_plan(seq: int, buckets: list[int], window: int | None = None,
               overhead: int = CHUNK_OVERHEAD_TOKENS) -> list[int]:
    """Chunk lengths (in order, summing to seq) for a prompt of `seq` columns; each chunk runs padded to
    its bucket. Whole largest-bucket chunks, and before them the remainder split into the pieces of least
    padded work plus `overhead` per chunk (1152 = 128 + 1024 rather than one 4096 chunk), smallest first.
    With bounded replay (window: the trimmed columns) the last chunk must hold the last window; if the
    remainder's split would end on a shorter piece, the remainder runs as one chunk."""
    largest = buckets[-1]
    full, rest = divmod(seq, largest)
    pieces = list(_split(rest, tuple(buckets), overhead)[1]) if rest else []
    if window is not None and not full and pieces[-1] < window:
        pieces = [rest]
    return pieces + [largest] * full


@functools.lru_cache(maxsize=4096)
def _split(rest: int, buckets: tuple[int, ...], overhead: int) -> tuple[int, tuple[int, ...]]:
    """(cost, ascending pieces) of the cheapest split of `rest` (< the largest bucket) into chunks."""
    best = (_bucket(buckets, rest) + overhead, (rest,))
    for size in buckets:
        if size < rest:
            cost, pieces = _split(rest - size, buckets, overhead)
            if cost + size + overhead < best[0]:
                best = (cost + size + overhead, tuple(sorted(pieces + (size,))))
    return best


class CompiledRunner:
    """Runs forwards on its own cache through compiled graphs; `DeepseekV41ForCausalLM.forward` calls it
    for that cache (any other cache runs eagerly)."""

    def __init__(self, model, options: CompileOptions):
        self.model, self.options = model, options
        text = model.model.text_config
        if text.emulate_reference_index_key_pointer:
            raise ValueError("compile(): DeepseekV41TextConfig.emulate_reference_index_key_pointer needs a host "
                             "sync per layer (it emulates a reference bug); turn it off to compile")
        overlap = options.mhc_overlap_max_tokens if options.mhc_overlap else 0
        defer = DEFER_MAX_TOKENS if options.mhc_defer_mixes else 0
        self.pass_manager = (passes.install(text, mhc_overlap_tokens=overlap, mhc_defer_tokens=defer,
                                            early_reads=options.early_reads, early_gemv=options.early_gemv,
                                            router_seam_experts=ROUTE_MAX_EXPERTS if options.router_in_seam else 0,
                                            linear_rope=options.linear_rope, linear_scale=options.linear_scale,
                                            seam_norm_gemv=options.seam_norm_gemv, kv_first=options.kv_first,
                                            linear_norm=options.linear_norm)
                             if options.passes else None)
        if not options.passes:
            passes.use(None)  # a manager installed earlier would still run
        # Round where the model rounds (its bf16 casts are the reference's rounding points); by default
        # Inductor keeps fused intermediates in fp32, which moves FP8/FP4 quantization steps.
        passes.keep_model_rounding()
        for layer in model.model.layers:
            layer.ffn.ensure_grouped(options.moe_shared_stacked and layer.ffn.can_stack_shared())
            layer.ffn.few_rows = options.moe_few_rows
            layer.ffn.few_tokens = options.moe_few_tokens
            layer.ffn.count_order = options.moe_count_order
            layer.ffn.order_op = options.moe_order_op
            layer.ffn.swiglu_op = options.moe_swiglu_op
            layer.ffn.token_sum_op = options.moe_token_sum_op
            layer.attn.fuse_input_projections(options.fuse_input_projections)
            layer.attn.rope_op = options.q_rope_op
            layer.attn.norms_op = options.qkv_norm_op
            layer.attn.ring_write_op = options.decode_ring_write_op
            layer.attn.own_key_op = options.attention_own_key
            layer.attn.compress_op = options.compress_token_op
            if layer.attn.compressor is not None:
                layer.attn.compressor.fuse_projections(options.compressor_gemv)
            if layer.engram is not None:
                layer.engram.embed.lookup_op = options.engram_lookup_op
            if layer.attn.indexer is not None:
                layer.attn.indexer.rope_op = options.index_rope_op
        for module in model.modules():  # after the fusion above, whose projections are new modules
            if type(module) is QuantLinear and module.weight.dtype == torch.bfloat16:
                module.few_rows = options.linear_few_rows
                module.gemv = options.linear_gemv
                long_k = module.groups * module.in_features >= LINEAR_TALL_MIN_K
                module.tall_rows = (LINEAR_TALL_MIN_ROWS, LINEAR_MAX_ROWS) if options.linear_tall and long_k else None
                module.qdq_op_rows = options.qdq_op_rows
            elif type(module) is Linear:
                fp32 = module.weight.dtype == torch.float32
                module.gemv = options.compressor_gemv if fp32 else options.plain_linear_gemv
        if options.swa_bounded_replay is not None:
            text.swa_bounded_replay = options.swa_bounded_replay
        self.cache = model.new_cache(options.max_batch, options.max_length)
        self.batch_buckets = sorted({b for b in options.batch_buckets if b < options.max_batch} | {options.max_batch})
        self.prefill_buckets = sorted({min(s, options.max_length) for s in options.prefill_buckets})
        if text.swa_bounded_replay and self.prefill_buckets[-1] < min(text.sliding_window, options.max_length):
            raise ValueError(f"compile(): the largest prefill bucket ({self.prefill_buckets[-1]}) must be at least "
                             f"the window ({text.sliding_window}): bounded replay runs the last chunk's last window "
                             "of tokens through the trimmed layers (or pass swa_bounded_replay=False)")
        # every block shares one code object: its cache holds (roles ~6) x (shapes) graphs; per batch bucket
        # the shapes are each prefill bucket at full depth and trimmed (bounded replay; the last KV source then
        # with the window's queries, or none in a chunk before the last), the window-long tail and the decode
        # step. Every compiled model of the process shares it, so each compile() adds its room.
        graphs = 8 * len(self.batch_buckets) * (2 * len(self.prefill_buckets) + 2)
        for limit in ("cache_size_limit", "accumulated_cache_size_limit"):
            setattr(torch._dynamo.config, limit, getattr(torch._dynamo.config, limit) + graphs)
        compile_kwargs = dict(backend=options.backend, fullgraph=True,
                              dynamic=None if options.dynamic_shapes else False)
        inductor_options = {}
        if options.dynamic_shapes:
            # Inductor's coalesce tiling analysis does not handle symbolic sizes: on the H200 (torch 2.11, 11-30)
            # it failed the serve compile with an AssertionError in tiling_utils.get_pw_red_splits (its config
            # note: "does not yet apply to dynamic shapes"; pytorch/pytorch#197077)
            inductor_options["triton.coalesce_tiling_analysis"] = False
        if options.inductor_pdl and hasattr(torch._inductor.config.triton, "enable_pdl"):  # torch 2.11 has it
            inductor_options["triton.enable_pdl"] = True
        if inductor_options and options.backend == "inductor":
            compile_kwargs["options"] = inductor_options
        for block in model.model.layers:
            block.compile(**compile_kwargs)
            if block.engram is not None and options.compile_engram:
                block.engram.compile(**compile_kwargs)
            elif block.engram is not None:
                block.engram._compiled_call_impl = None  # eager again (a model compiled before with it on)
        inner = model.model
        for name in ("begin", "collapse", "advance"):  # the methods again (compiled by an earlier compile())
            inner.__dict__.pop(name, None)
        if options.compile_setup:
            setup_kwargs = compile_kwargs
            if options.setup_combo_kernels and options.backend == "inductor":
                combo = {**compile_kwargs.get("options", {}), "combo_kernels": True}
                setup_kwargs = dict(compile_kwargs, options=combo)
            inner.begin = torch.compile(inner.begin, **setup_kwargs)
        if options.compile_finish:
            inner.collapse = torch.compile(inner.collapse, **compile_kwargs)
            inner.advance = torch.compile(inner.advance, **compile_kwargs)
        self.cuda_graphs = options.cuda_graphs and model.device.type == "cuda"
        self.graphs: dict[int, tuple] = {}  # batch bucket -> (graph, static logits, static ids, static mask)
        self.chunk_graphs: dict[tuple, tuple] = {}  # (ids shape, tail, replay_from given) -> (graph, inputs, out)
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.trimmed = TrimmedGraphs(model.model, self.pool) if self.cuda_graphs and options.trimmed_graphs else None
        # (runner.cuda_graphs = False later turns every kind off: tests compare with and without graphs)

    def _decode_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model.model.run(input_ids, attention_mask, self.cache, self.cache.max_length)
        return self.model.logits(hidden)

    def _capture(self, step, pieces: int = 1) -> tuple:
        """(CUDA graph, its output) of `step()` (a forward on static inputs), as `pieces` graphs of growing
        numbers of blocks (PiecewiseGraph, piece_sizes). The warm-up runs (which compile the blocks for these shapes)
        change the cache, so its tensors are saved (a copy the size of the cache) and restored after each: a
        second run from where the first left off could pass max_length."""
        saved = self.cache.save_state()
        side = torch.cuda.Stream()
        for _ in range(2):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            self.cache.restore_state(saved)
        del saved
        layers = self.model.model.layers
        starts = itertools.accumulate(piece_sizes(len(layers), pieces, self.options.decode_graph_growth)[:-1])
        cuts = {layers[i] for i in starts}
        if pieces > 1 and self.options.decode_graph_setup_piece:
            cuts.add(layers[0])
        graph = PiecewiseGraph(self.pool)
        self.model.model.block_hook = lambda block: graph.cut() if block in cuts else None
        try:
            with graph.capture():
                out = step()
        finally:
            self.model.model.block_hook = None
        return graph, out

    def _decode_graph(self, rows: int) -> tuple:
        """The decode step's CUDA graph for `rows` rows, captured on first use."""
        if rows not in self.graphs:
            ids = _static(torch.zeros(rows, 1, dtype=torch.long, device=self.model.device))
            mask = _static(torch.ones_like(ids))
            pieces = 1 if self.options.mhc_overlap else self.options.decode_graph_pieces
            step = self._capture(lambda: self._decode_step(ids, mask), pieces)
            self.graphs[rows] = (*step, ids, mask)
        return self.graphs[rows]

    def _prefill_chunk(self, ids, mask, tail, replay_from) -> torch.Tensor | None:
        """One padded prompt chunk (DeepseekV41Model.run): replayed from its own CUDA graph if it has at most
        options.prefill_graph_tokens tokens, else its compiled blocks launched one by one (the trimmed layers
        then replaying theirs)."""
        model = self.model.model
        if not self.cuda_graphs or ids.numel() > self.options.prefill_graph_tokens:
            return model.run(_fresh(ids), _fresh(mask), self.cache, self.cache.max_length, tail,
                             _fresh(replay_from), self.trimmed if self.cuda_graphs else None)
        key = (tuple(ids.shape), tail, replay_from is None)
        if key not in self.chunk_graphs:
            inputs = [_static(ids), _static(mask), _static(replay_from)]
            graph, out = self._capture(lambda: model.run(inputs[0], inputs[1], self.cache, self.cache.max_length,
                                                         tail, inputs[2]))
            self.chunk_graphs[key] = (graph, inputs, out)
        graph, inputs, out = self.chunk_graphs[key]
        for static, given in zip(inputs, (ids, mask, replay_from)):
            if static is not None:
                static.copy_(given)
        graph.replay()
        return None if out is None else out.clone()  # the next replay rewrites the graph's output buffer

    def fresh_cache(self, batch: int, max_length: int):
        """The runner's cache, emptied, for a generate() call of `batch` rows up to `max_length` columns."""
        if batch > self.options.max_batch or max_length > self.options.max_length:
            raise CacheCapacityError(
                f"generate() needs batch {batch} x length {max_length}, but the model was compiled with "
                f"max_batch={self.options.max_batch}, max_length={self.options.max_length}")
        self.cache.reset()
        return self.cache

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int = 0,
                 replay_from: torch.Tensor | None = None):
        """input_ids, attention_mask [B, S]: the new columns for the cache's first B rows. Returns fp32
        logits of the last `logits_to_keep` columns (all with 0). replay_from: a prefix-cache hit (see
        DeepseekV41Model.run)."""
        with launches(self.options.pdl):  # what graphs captured here launch (replays keep it)
            return self._forward(input_ids, attention_mask, logits_to_keep, replay_from)

    def _forward(self, input_ids, attention_mask, logits_to_keep, replay_from):
        batch, seq = input_ids.shape
        self.cache.check_fits(batch, seq)
        rows = _bucket(self.batch_buckets, batch) - batch
        if rows:
            input_ids, attention_mask = F.pad(input_ids, (0, 0, 0, rows)), F.pad(attention_mask, (0, 0, 0, rows))
            replay_from = None if replay_from is None else F.pad(replay_from, (0, rows))
        if seq == 1 and self.cuda_graphs:
            graph, out, ids, mask = self._decode_graph(input_ids.shape[0])
            torch._foreach_copy_((ids, mask), (input_ids, attention_mask))  # one call: the GPU waits for it
            graph.replay()
            logits = out[:batch].clone()  # the graph's output buffer is rewritten by the next replay
        elif seq == 1:
            logits = self._decode_step(_fresh(input_ids), _fresh(attention_mask))[:batch]
        else:
            check_left_padding(attention_mask)
            hidden = self._prefill_chunks(input_ids, attention_mask, logits_to_keep or seq, replay_from)
            logits = self.model.logits(hidden[:batch])
        self.cache.seen_columns += seq
        return logits[:, -logits_to_keep:] if logits_to_keep else logits

    def _prefill_chunks(self, input_ids, attention_mask, keep: int, replay_from=None) -> torch.Tensor:
        """Run the columns in the chunks `chunk_plan` picks, each left-padded to its bucket; returns the
        hidden states of the last `keep` columns. With bounded replay only the last chunk (which holds every
        row's last window of tokens) runs the layers after the last KV source, on those tokens; the chunks
        before it stop at the last KV source's cache writes."""
        model, seq = self.model.model, input_ids.shape[1]
        window = model.replay_tail(seq, keep)  # None: no trimming; else the last chunk (>= window) is trimmed
        edges = [0]
        for length in chunk_plan(seq, self.prefill_buckets, window):
            edges.append(edges[-1] + length)
        kept = []
        for start, end in zip(edges[:-1], edges[1:]):
            ids, mask = input_ids[:, start:end], attention_mask[:, start:end]
            last = end == seq
            tail = None if window is None else window if last else 0
            pad = _bucket(self.prefill_buckets, end - start) - (end - start)
            hidden = self._prefill_chunk(F.pad(ids, (pad, 0)), F.pad(mask, (pad, 0)), tail, replay_from)
            if hidden is not None and end > seq - keep:
                kept.append(hidden if tail else hidden[:, pad:])
        return torch.cat(kept, dim=1)[:, -keep:]

    def _warm_lengths(self) -> list[int]:
        """Prompt lengths that compile every one-chunk prefill shape: each bucket's full length and, where
        bounded replay trims that bucket's longer prompts, also the longest untrimmed one (the window) if it
        lands in the same bucket (then the layers after the cut run there on the whole bucket)."""
        window = self.model.model.text_config.sliding_window
        lengths = set(self.prefill_buckets)
        if self.model.model.text_config.swa_bounded_replay and window not in lengths:
            lengths.add(window)
        return sorted(n for n in lengths if n <= self.prefill_buckets[-1])

    @torch.no_grad()  # as generate() runs: graphs compiled with grad mode on would not serve it
    def warm_up(self, batch_sizes=None, prefill_lengths=None) -> None:
        """Compile the blocks and capture the CUDA graphs (decode, prefill chunks, trimmed layers) for these
        batch sizes and prompt lengths now, on throwaway inputs (with bounded replay also every bucket as a
        chunk before a prompt's last, which stops at the last KV source's cache writes); the cache is emptied
        afterwards."""
        with launches(self.options.pdl):
            self._warm_up(batch_sizes or self.batch_buckets, prefill_lengths or self._warm_lengths())

    def _warm_up(self, batch_sizes, lengths) -> None:
        for batch in batch_sizes:
            ids = torch.zeros(batch, max(lengths), dtype=torch.long, device=self.model.device)
            # with a prefix cache every prefill carries replay_from (zeros without a hit): the same graphs.
            # Contiguous like use_hits' (a column view's stride would fail the graphs' guards)
            replay = None if self.model.prefix_cache is None else ids.new_zeros(batch)
            for length in lengths:
                self.cache.reset()
                self(ids[:, :length], torch.ones_like(ids[:, :length]), 1, replay)
            rows = _bucket(self.batch_buckets, batch)
            for length in self.prefill_buckets if self.model.model.text_config.swa_bounded_replay else ():
                self.cache.reset()
                chunk = ids.new_zeros(rows, length)
                self._prefill_chunk(chunk, torch.ones_like(chunk), 0, None if replay is None else ids.new_zeros(rows))
            self.cache.reset()
            self(ids[:, :1], torch.ones_like(ids[:, :1]), 1)  # one decode step: compiles / captures its graph
        self.cache.reset()


def compile(model, *, max_batch: int = 8, max_length: int = 4096, **options):  # noqa: A001 (torch.compile's name)
    """Compile `model` (a DeepseekV41ForCausalLM) in place for decode and prefill; returns the model.
    Options: see CompileOptions. `model.compiled_runner` holds the graphs, the cache and the passes'
    match counts (`compiled_runner.pass_manager.matches`)."""
    model.compiled_runner = CompiledRunner(model, CompileOptions(max_batch=max_batch, max_length=max_length,
                                                                 **options))
    return model
