"""DeepSeek-V4.1-Flash as a Hugging Face causal LM (MODEL.md: the contract).

    streams = embed(ids) repeated hc times, pre-mix one-hot on stream 0
    for each layer: [Engram] -> block (lagged mHC around attention and MoE)
    logits = head(norm(pre(streams, last pre-mix)))   (fp32)

Module and parameter names follow the release checkpoint under `model.` (the head sits at the top, as
`head`), so loading is a prefix strip (checkpoint.py does the formats).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from . import engram_hash, prefix_cache, prefix_state
from .attention import Attention
from .cache import DeepseekV41Cache, LayerCache
from .configuration_deepseek_v41 import DeepseekV41Config, DeepseekV41TextConfig, LayerRole
from .context import ForwardContext, build_context, check_left_padding, tail_context
from .engram import Engram
from .layers import RMSNorm, fp32_linear
from .mhc import PendingPost, expanded, hc_mixes, hc_post, hc_pre
from .moe import MoE
from .rope import inverse_frequencies, rotation

# transformers renamed generate()'s cache keyword from `past_key_values` to `cache` (5.24); accept both.
CACHE_KWARG = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
    else "past_key_values"


# generate() reads the cache back from the output under the name its version uses.
if CACHE_KWARG == "cache":
    @dataclass
    class DeepseekV41CausalLMOutput(ModelOutput):
        logits: torch.Tensor | None = None
        cache: DeepseekV41Cache | None = None
        hidden_states: torch.Tensor | None = None
else:
    @dataclass
    class DeepseekV41CausalLMOutput(ModelOutput):
        logits: torch.Tensor | None = None
        past_key_values: DeepseekV41Cache | None = None
        hidden_states: torch.Tensor | None = None


class DeepseekV41Block(nn.Module):
    def __init__(self, config: DeepseekV41TextConfig, role: LayerRole, engram_rows: int | None):
        super().__init__()
        self.role = role
        self.last = role.layer == config.num_hidden_layers - 1  # no seam after it: it expands its MoE's output
        self.norm_eps, self.hc_eps, self.iters = config.rms_norm_eps, config.hc_eps, config.hc_sinkhorn_iters
        hc, dim = config.hc_mult, config.hidden_size
        mix = (2 + hc) * hc
        self.attn_norm = RMSNorm(dim, config.rms_norm_eps)
        self.attn = Attention(config, role)
        self.ffn_norm = RMSNorm(dim, config.rms_norm_eps)
        self.ffn = MoE(config)
        self.engram = Engram(config, engram_rows) if engram_rows is not None else None
        for seam in ("attn", "ffn"):
            self.register_parameter(f"hc_{seam}_fn", nn.Parameter(torch.zeros(mix, hc * dim)))
            self.register_parameter(f"hc_{seam}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{seam}_scale", nn.Parameter(torch.ones(3)))

    def mixes(self, streams: torch.Tensor, seam: str):
        return hc_mixes(streams, getattr(self, f"hc_{seam}_fn"), getattr(self, f"hc_{seam}_scale"),
                        getattr(self, f"hc_{seam}_base"), self.norm_eps, self.hc_eps, self.iters)

    def forward(self, streams: torch.Tensor | PendingPost, pre_mix: torch.Tensor, ctx: ForwardContext,
                state: LayerCache, topk: torch.Tensor | None = None, queries: int | None = None):
        """streams [B, S, hc, D], or the previous block's with its MoE output still to expand (PendingPost);
        pre_mix [B, S, hc] from the previous block; state: this layer's cache tensors; topk: the latest
        index source's top-k of this layer's ratio. Returns the new streams as a PendingPost (the MoE's
        expansion is left to the next block's first seam; the last block expands them), the pre-mix for the next
        block (lagged: each sublayer uses the pre computed one seam earlier) and the top-k this layer
        attended. queries: only the last `queries` columns go on past the attention's cache writes (bounded
        replay at the last KV source; see Attention.forward): the streams and pre-mix returned have those
        columns (0: the cache writes alone, returning Nones)."""
        streams = expanded(streams)
        attn_pre, attn_post, attn_comb = self.mixes(streams, "attn")
        out, topk = self.attn(self.attn_norm(hc_pre(streams, pre_mix)), ctx, state, topk, queries)
        if queries == 0:
            return None, None, topk
        if queries is not None:  # the seam above ran on every column (one fused entry seam); cut after it
            streams, attn_pre, attn_post, attn_comb = (t[:, -queries:] for t in (streams, attn_pre, attn_post,
                                                                                 attn_comb))
        streams = hc_post(out, streams, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.mixes(streams, "ffn")
        out = self.ffn(self.ffn_norm(hc_pre(streams, attn_pre)))
        streams = PendingPost(out, streams, ffn_post, ffn_comb)
        return expanded(streams) if self.last else streams, ffn_pre, topk


class DeepseekV41PreTrainedModel(PreTrainedModel):
    config_class = DeepseekV41Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DeepseekV41Block"]
    _is_stateful = True  # a static per-row cache: no beam search / cache reordering

    def _init_weights(self, module: nn.Module) -> None:
        from .init import init_module  # random presets only; kept apart from the math

        if any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
            return  # built on the meta device by from_pretrained: the checkpoint fills it
        init_module(module, self.config.get_text_config())

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, device_map=None, dtype=None,
                        torch_dtype=None, engram_token_map=None, parallel=None, **kwargs):
        """Load a local folder in the release layout (config.json + model.safetensors or shards + index).

        device_map: None/"cpu", "cuda", "cuda:N", "auto" or a one-device dict. engram_token_map: overrides
        the folder's `engram_token_map.safetensors` / `tokenizer.json`. Other keyword arguments set
        DeepseekV41TextConfig fields (e.g. quantize_dequantize=False, or weights="native" / "bf16": FP8 and
        MXFP4 projections kept as stored or dequantized; by default native on CUDA, bf16 elsewhere).
        parallel: (ParallelConfig, process group): this rank reads only its own routed experts and gets the
        model sharded for it (parallel.py)."""
        from .pretrained import load_pretrained

        if model_args:
            raise TypeError(f"from_pretrained takes no positional model arguments, got {len(model_args)}")
        for hub_only in ("trust_remote_code", "revision", "cache_dir", "local_files_only", "token", "force_download",
                         "low_cpu_mem_usage", "use_safetensors", "attn_implementation", "_from_auto",
                         "adapter_kwargs", "_commit_hash", "subfolder", "proxies"):
            kwargs.pop(hub_only, None)  # accepted for compatibility with AutoModel; nothing to do locally
        return load_pretrained(cls, pretrained_model_name_or_path, config=config, device_map=device_map,
                               dtype=dtype if dtype is not None else torch_dtype, engram_token_map=engram_token_map,
                               parallel=parallel, **kwargs)

    def save_pretrained(self, save_directory, max_shard_size=None, **kwargs) -> None:
        """Write config.json and the release layout (single file, or shards + index with max_shard_size)."""
        from .pretrained import save_pretrained

        save_pretrained(self, save_directory, max_shard_size=max_shard_size)


class DeepseekV41Model(DeepseekV41PreTrainedModel):
    def __init__(self, config: DeepseekV41Config):
        super().__init__(config)
        text = config.get_text_config()
        self.text_config = text
        self.hc = text.hc_mult
        self.embed = nn.Embedding(text.vocab_size, text.hidden_size, dtype=torch.bfloat16)
        self.engram_params = None
        rows = {}
        if text.engram_layer_ids:
            self.engram_params = engram_hash.derive_hash_params(
                text.engram_layer_ids, text.engram_max_ngram_size, text.engram_n_heads, text.engram_vocab_size,
                text.engram_compressed_vocab_size, pad_compressed_id=0)
            derived = list(self.engram_params.table_rows)
            if derived != list(text.engram_num_embeddings):
                raise ValueError(f"DeepseekV41TextConfig.engram_num_embeddings is {text.engram_num_embeddings} but "
                                 f"the primes of engram_vocab_size={text.engram_vocab_size} give {derived} rows")
            rows = dict(zip(text.engram_layer_ids, derived))
        self.layers = nn.ModuleList(DeepseekV41Block(text, role, rows.get(role.layer)) for role in text.layer_roles)
        self.block_hook = None  # called with each block before it runs (the compiled runner cuts graphs there)
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.register_buffer("engram_token_map", torch.arange(text.vocab_size), persistent=False)
        self.engram_token_map_is_identity = True
        self.register_buffer("window_inv_freq", inverse_frequencies(text.qk_rope_head_dim, text.rope_theta),
                             persistent=False)
        self.register_buffer("compressed_inv_freq", inverse_frequencies(
            text.qk_rope_head_dim, text.compress_rope_theta, text.rope_scaling), persistent=False)
        self.post_init()

    def rebuild_buffers(self, device) -> None:
        """Recompute the non-checkpoint buffers (after a meta-device build)."""
        text = self.text_config
        self.window_inv_freq = inverse_frequencies(text.qk_rope_head_dim, text.rope_theta).to(device)
        self.compressed_inv_freq = inverse_frequencies(text.qk_rope_head_dim, text.compress_rope_theta,
                                                       text.rope_scaling).to(device)
        self.engram_token_map = torch.arange(text.vocab_size, device=device)
        self.engram_token_map_is_identity = True

    # -- Engram token map --------------------------------------------------------------------------
    def set_engram_token_map(self, token_map: torch.Tensor) -> None:
        """Token id -> compressed id (MODEL.md 3.1), e.g. engram_hash.load_token_map(folder)."""
        text = self.text_config
        token_map = torch.as_tensor(token_map, dtype=torch.long)
        if token_map.shape != (text.vocab_size,):
            raise ValueError(f"engram token map has shape {tuple(token_map.shape)}; expected ({text.vocab_size},)")
        distinct = int(token_map.max()) + 1
        if distinct != text.engram_compressed_vocab_size:
            raise ValueError(f"engram token map has {distinct} compressed ids but "
                             f"DeepseekV41TextConfig.engram_compressed_vocab_size is {text.engram_compressed_vocab_size}")
        self.engram_token_map.copy_(token_map)
        self.engram_token_map_is_identity = False

    def engram_pad_id(self) -> int:
        return int(self.engram_token_map[self.text_config.engram_pad_token_id])

    def _check_token_map(self) -> None:
        text = self.text_config
        if self.engram_params and self.engram_token_map_is_identity and \
                text.engram_compressed_vocab_size != text.vocab_size:
            raise ValueError("Engram needs a token map (engram_compressed_vocab_size "
                             f"{text.engram_compressed_vocab_size} != vocab_size {text.vocab_size}): load from a "
                             "folder with engram_token_map.safetensors or tokenizer.json, or call "
                             "set_engram_token_map()")

    # -- forward -----------------------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DeepseekV41Cache,
                keep: int | None = None, replay_from: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask [B, S] (new columns). Returns the final-norm hidden states and advances
        the cache: [B, S, D], or, when bounded replay trims this chunk (see `replay_tail`), the last
        `sliding_window` columns only. keep: the trailing columns whose outputs the caller needs (None: all).
        replay_from: see `run` (a prefix-cache hit)."""
        batch, seq = input_ids.shape
        cache.check_fits(batch, seq)
        check_left_padding(attention_mask)
        hidden = self.run(input_ids, attention_mask, cache, cache.seen_columns + seq, self.replay_tail(seq, keep),
                          replay_from)
        cache.seen_columns += seq
        return hidden

    def replay_tail(self, seq: int, keep: int | None) -> int | None:
        """Columns the layers after the last KV source run on in a chunk of `seq` columns of which the caller
        needs the last `keep` (None: all): the last `sliding_window` if bounded replay is on, the chunk is
        longer than the window and keep fits in it; None (every column) otherwise."""
        window = self.text_config.sliding_window
        if self.text_config.swa_bounded_replay and keep is not None and keep <= window < seq:
            return window
        return None

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DeepseekV41Cache,
            columns_after: int, tail: int | None = None, replay_from: torch.Tensor | None = None,
            trimmed=None) -> torch.Tensor | None:
        """The tensor work of a forward: no host syncs and no host-side cache state, so compiled graphs
        capture exactly this (build_context explains `columns_after`). The caller checks the input and
        advances `cache.seen_columns`. tail: run the layers after the last KV source on the last `tail`
        columns only, and the last KV source itself past its cache writes (bounded replay; the result then
        has those columns), or neither with 0 (a prompt chunk before the last: returns None); None runs
        every layer on every column. trimmed: what runs
        those layers on the tail (same arguments as `run_trimmed`, its default; the compiled runner passes
        its CUDA graphs).
        replay_from [B]: a prefix-cache hit ending at H was restored into each row (compressed rows and
        index keys below H, cache length H - W; 0 for a row without a hit): the columns from H - W on are
        replayed, every layer's window sees nothing below H - W, and the restored rows are not rewritten.
        Position-based, so it holds for every chunk of a chunked prompt."""
        ctx, streams, pre_mix, hash_ids = self.begin(input_ids, attention_mask, cache, columns_after, replay_from)
        if tail is None:
            hidden = self.collapse(*self.run_layers(self.layers, ctx, cache, streams, pre_mix, hash_ids))
        else:
            cut = self.text_config.last_kv_source_layer + 1
            streams, pre_mix = self.run_layers(self.layers[:max(cut - 1, 0)], ctx, cache, streams, pre_mix, hash_ids)
            if cut:  # the last KV source writes keys for every column; its queries and FFN need only the tail
                streams, pre_mix = self.run_layers(self.layers[cut - 1:cut], ctx, cache, streams, pre_mix, hash_ids,
                                                   queries=tail)
            elif tail:
                streams, pre_mix = streams[:, -tail:].contiguous(), pre_mix[:, -tail:].contiguous()
            hidden = None
            if tail:
                later = {layer: ids[:, -tail:].contiguous() for layer, ids in hash_ids.items() if layer >= cut}
                hidden = (trimmed or self.run_trimmed)(tail_context(ctx, attention_mask, tail), cache, streams,
                                                       pre_mix, later)
        self.advance(ctx)
        return hidden

    def run_layers(self, layers, ctx: ForwardContext, cache: DeepseekV41Cache, streams: torch.Tensor,
                   pre_mix: torch.Tensor, hash_ids: dict, queries: int | None = None):
        """Run these decoder blocks in order; an index source publishes its top-k into ctx.topk. queries:
        passed to the blocks (bounded replay's last KV source). The streams returned are a PendingPost unless the
        last of them is the model's last block (DeepseekV41Block.last)."""
        for block in layers:
            if self.block_hook is not None:
                self.block_hook(block)
            role = block.role
            if block.engram is not None:
                streams = block.engram(streams, hash_ids[role.layer])
            streams, pre_mix, topk = block(streams, pre_mix, ctx, cache.layer(role), ctx.topk.get(role.topk_layer),
                                           queries)
            if role.is_index_source:
                ctx.topk[role.layer] = topk
        return streams, pre_mix

    def run_trimmed(self, ctx: ForwardContext, cache: DeepseekV41Cache, streams: torch.Tensor,
                    pre_mix: torch.Tensor, hash_ids: dict) -> torch.Tensor:
        """Bounded replay's trimmed part on the tail columns (ctx from tail_context): the layers after the
        last KV source, then the final norm."""
        cut = self.text_config.last_kv_source_layer + 1
        return self.collapse(*self.run_layers(self.layers[cut:], ctx, cache, streams, pre_mix, hash_ids))

    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DeepseekV41Cache,
              columns_after: int, replay_from: torch.Tensor | None = None):
        """Per-forward set-up: positions and window lists (see `run` for replay_from), RoPE rotations,
        Engram hash ids (per Engram layer) with the cache's n-gram history advanced, and the initial streams
        and one-hot pre-mix."""
        batch, seq = input_ids.shape
        floor = None if replay_from is None else (replay_from - self.text_config.sliding_window).clamp_min(0)
        ctx = build_context(cache, attention_mask, columns_after, window_floor=floor)
        ctx.write_floor = replay_from
        ctx.inv_freq = {"window": self.window_inv_freq, "compressed": self.compressed_inv_freq}
        safe_pos = ctx.positions.clamp_min(0)
        ctx.rotations = {kind: rotation(safe_pos, f) for kind, f in ctx.inv_freq.items()}
        # every KV source of a ratio lays its compressed rows out alike, every index source reads the same visible
        # counts: here, so that each block finds them made
        roles = self.text_config.layer_roles
        for ratio in sorted({role.ratio for role in roles if role.is_kv_source}):
            ctx.group_rows(ratio)
        for ratio in sorted({role.ratio for role in roles if role.is_index_source}):
            ctx.visible(ratio)

        hash_ids = {}
        if self.engram_params is not None:
            self._check_token_map()
            compressed = torch.where(ctx.positions >= 0, self.engram_token_map[input_ids], cache.engram_pad_id)
            history, compressed = engram_hash.padding_first(cache.engram_history[:batch], compressed,
                                                            (ctx.positions < 0).sum(1))
            for i, layer in enumerate(self.engram_params.layer_ids):
                hash_ids[layer] = engram_hash.engram_hash_ids(compressed, history, self.engram_params, i)
            cache.engram_history[:batch] = engram_hash.update_history(history, compressed)

        streams = self.embed(input_ids).unsqueeze(2).repeat(1, 1, self.hc, 1)
        pre_mix = streams.new_zeros(batch, seq, self.hc, dtype=torch.float32)
        pre_mix[..., 0] = 1.0
        return ctx, streams, pre_mix, hash_ids

    def collapse(self, streams: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        """The last block's streams collapsed into one and normed: the hidden states the head reads."""
        return self.norm(hc_pre(streams, pre_mix))

    @staticmethod
    def advance(ctx: ForwardContext) -> None:
        """Advance the cache's per-row lengths past the chunk."""
        ctx.cache.lengths[:ctx.batch] += (ctx.positions >= 0).sum(1)


class DeepseekV41ForCausalLM(DeepseekV41PreTrainedModel, GenerationMixin):
    def __init__(self, config: DeepseekV41Config):
        super().__init__(config)
        text = config.get_text_config()
        self.model = DeepseekV41Model(config)
        self.head = nn.Linear(text.hidden_size, text.vocab_size, bias=False, dtype=torch.bfloat16)
        self.prefix_cache: prefix_cache.PrefixCache | None = None  # see enable_prefix_cache
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def enable_prefix_cache(self, budget_bytes: int, block_size: int | None = None) -> prefix_cache.PrefixCache:
        """Keep prompt prefixes across calls (a multi-turn conversation's next prompt extends the last): a
        prefill into an empty cache restores its longest cached prefix beyond the window and replays only the
        last window before it (SYSTEM.md, bounded replay). Needs `swa_bounded_replay` (with it off prompts
        are recomputed in full). block_size: tokens per hashed block (default: the window)."""
        text = self.model.text_config
        block = block_size or text.sliding_window
        if block % prefix_state.alignment(text):
            raise ValueError(f"enable_prefix_cache: block_size {block} must be a multiple of the compression "
                             f"ratios ({prefix_state.alignment(text)})")
        self.prefix_cache = prefix_cache.PrefixCache(block, text.sliding_window, budget_bytes)
        return self.prefix_cache

    def new_cache(self, max_batch: int, max_length: int, **formats) -> DeepseekV41Cache:
        """A static cache for this model (rows reused across calls after `cache.reset()`). formats:
        window_format / compressed_format / index_format (default "auto": packed records on CUDA)."""
        cache = DeepseekV41Cache(self.model.text_config, max_batch, max_length, device=self.device, **formats)
        cache.set_engram_pad_id(self.model.engram_pad_id())
        return cache

    def empty_cache(self, max_batch: int, max_length: int) -> DeepseekV41Cache:
        """An empty cache for a call: compiled, the runner's own (emptied; its graphs run only on it), else a
        new one."""
        runner = getattr(self, "compiled_runner", None)
        return (runner.fresh_cache if runner is not None else self.new_cache)(max_batch, max_length)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: DeepseekV41Cache | None = None, past_key_values: DeepseekV41Cache | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs) -> DeepseekV41CausalLMOutput:
        """input_ids [B, S]: the columns not yet in `cache`. attention_mask [B, >= S] (1 = real token,
        padding on the left); its last S columns describe the new ones. Without a cache, a temporary one
        sized to this input is used. logits_to_keep=k > 0 computes logits for the last k columns only (and lets
        bounded replay trim a long prompt chunk, see DeepseekV41Model.replay_tail)."""
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("inputs_embeds is not supported: Engram hashes the token ids, so pass input_ids")
        cache = cache if cache is not None else past_key_values
        if cache is None:
            cache = self.new_cache(input_ids.shape[0], input_ids.shape[1])
        seq = input_ids.shape[1]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        elif attention_mask.shape[1] < seq:
            raise ValueError(f"attention_mask has {attention_mask.shape[1]} columns for {seq} new input ids")
        attention_mask, replay_from, prompts = attention_mask[:, -seq:], None, None
        store = self.prefix_cache
        if (store is not None and cache.seen_columns == 0 and seq > 1 and logits_to_keep and not output_hidden_states
                and self.model.text_config.swa_bounded_replay):
            input_ids, attention_mask, replay_from, prompts = prefix_cache.use_hits(store, self, cache, input_ids,
                                                                                    attention_mask)
            cache.seen_columns = seq - input_ids.shape[1]  # the restored columns count as consumed
        runner = getattr(self, "compiled_runner", None)
        if runner is not None and cache is runner.cache and not output_hidden_states:
            logits = runner(input_ids, attention_mask, logits_to_keep, replay_from)
            hidden = None
        else:
            needed = None if output_hidden_states or not logits_to_keep else logits_to_keep
            # A compiled model's graphs are its runner's: outside it (another cache, or hidden states asked for)
            # the blocks run eager, since recompiling them for each new shape would soon stop at Dynamo's
            # recompile limit. The stance is process-wide (restored on exit, errors included).
            eager = runner is not None
            with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
                hidden = self.model(input_ids, attention_mask, cache, keep=needed, replay_from=replay_from)
            logits = self.logits(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        if prompts is not None:
            prefix_cache.keep_prefixes(store, cache, prompts)
        keep = use_cache is not False
        return DeepseekV41CausalLMOutput(logits=logits, hidden_states=hidden if output_hidden_states else None,
                                         **{CACHE_KWARG: cache if keep else None})

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of bf16 hidden states (the reference's fp32 head)."""
        return fp32_linear(hidden, self.head.weight)

    # -- generate() glue ---------------------------------------------------------------------------
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length, *args, **kwargs):
        if model_kwargs.get(CACHE_KWARG) is not None or generation_config.use_cache is False:
            return
        model_kwargs[CACHE_KWARG] = self.empty_cache(batch_size, max_cache_length)

    def _prepare_attention_mask_for_generation(self, inputs_tensor, generation_config, model_kwargs):
        """Without an explicit mask, only a leading run of pad ids is padding: the release treats the pad
        id inside a prompt as an ordinary token (transformers' default would mask every occurrence)."""
        mask = super()._prepare_attention_mask_for_generation(inputs_tensor, generation_config, model_kwargs)
        return mask.cummax(dim=1).values

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs) -> dict:
        cache = kwargs.get(CACHE_KWARG)
        seen = cache.get_seq_length() if cache is not None else 0
        inputs = {"input_ids": input_ids[:, seen:], CACHE_KWARG: cache, "attention_mask": kwargs.get("attention_mask"),
                  "use_cache": kwargs.get("use_cache")}
        if kwargs.get("logits_to_keep") is not None:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs
