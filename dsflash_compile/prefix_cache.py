"""The prefix cache: prefix states (prefix_state.PrefixState) keyed by the hashes of their token blocks,
least recently used first out within a byte budget.

Blocks are `block_size` tokens (a multiple of every compression ratio, so a block boundary leaves no
compressor group open). The key of a prefix of k blocks chains the blocks' hashes, so a lookup walks the
prompt block by block. An entry stored for a prefix of H tokens also serves every shorter prefix it
contains (the first rows of a longer prefix are those of the shorter one), so storing a prefix that
extends a stored one replaces it: a conversation keeps one entry, its latest turn. Hits no longer than
the window are not used: the replay of the last window would need tokens before the prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .prefix_state import PrefixState, restore, snapshot


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0
    hit_tokens: int = 0  # prefix tokens served from the cache


@dataclass
class _Entry:
    state: PrefixState
    keys: list[int] = field(default_factory=list)  # the block-chain key of each of its prefixes


class PrefixCache:
    def __init__(self, block_size: int, window: int, budget_bytes: int):
        if block_size < 1 or budget_bytes < 1:
            raise ValueError(f"PrefixCache: block_size ({block_size}) and budget_bytes ({budget_bytes}) must be >= 1")
        self.block_size, self.window, self.budget_bytes = block_size, window, budget_bytes
        self.entries: OrderedDict[int, _Entry] = OrderedDict()  # by the key of the whole prefix; LRU first
        self.index: dict[int, int] = {}  # key of any stored prefix length -> the entry holding it
        self.nbytes = 0
        self.stats = PrefixCacheStats()

    def _chain(self, tokens: list[int]) -> list[int]:
        """Key of the first k full blocks, for k = 1, 2, ..."""
        keys, key = [], 0
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            key = hash((key, tuple(tokens[start:start + self.block_size])))
            keys.append(key)
        return keys

    def lookup(self, tokens: list[int]) -> PrefixState | None:
        """The state of the longest cached prefix of `tokens` longer than the window (None: a miss)."""
        keys = self._chain(tokens)
        for blocks in range(len(keys), 0, -1):
            length = blocks * self.block_size
            if length <= self.window:
                break
            owner = self.index.get(keys[blocks - 1])
            if owner is not None:
                self.entries.move_to_end(owner)
                self.stats.hits += 1
                self.stats.hit_tokens += length
                return self.entries[owner].state.truncated(length)
        self.stats.misses += 1
        return None

    def holds(self, tokens: list[int]) -> bool:
        """Whether some entry already serves the prefix made of `tokens`' whole blocks."""
        keys = self._chain(tokens)
        return bool(keys) and keys[-1] in self.index

    def insert(self, tokens: list[int], state: PrefixState) -> bool:
        """Keep `state` (the state of the first state.length of `tokens`, a whole number of blocks);
        evicts the least recently used entries to stay within the budget. Returns whether it was kept
        (a state larger than the whole budget is not)."""
        if state.length % self.block_size or state.length > len(tokens):
            raise ValueError(f"PrefixCache.insert: a state of {state.length} tokens for {len(tokens)} tokens "
                             f"(must be whole blocks of {self.block_size} within the tokens)")
        if state.nbytes > self.budget_bytes:
            return False
        keys = self._chain(tokens[:state.length])
        if keys[-1] in self.entries:
            self.entries.move_to_end(keys[-1])
            return True
        for key in keys[:-1]:  # an entry for a shorter prefix of these tokens: the new one holds it too
            if key in self.entries:
                self._remove(key)
        while self.nbytes + state.nbytes > self.budget_bytes:
            self._remove(next(iter(self.entries)))
            self.stats.evictions += 1
        self.entries[keys[-1]] = _Entry(state, keys)
        for key in keys:  # a shorter prefix already held by another entry stays with it
            self.index.setdefault(key, keys[-1])
        self.nbytes += state.nbytes
        self.stats.inserts += 1
        return True

    def _remove(self, key: int) -> None:
        entry = self.entries.pop(key)
        for prefix_key in entry.keys:
            if self.index.get(prefix_key) == key:
                del self.index[prefix_key]
        # a prefix of the removed entry may still live in another entry
        for other_key, other in self.entries.items():
            for prefix_key in other.keys:
                self.index.setdefault(prefix_key, other_key)
        self.nbytes -= entry.state.nbytes


def use_hits(store: PrefixCache, model, cache, input_ids, attention_mask):
    """Before a prompt's prefill into an empty cache: restore each row's longest cached prefix (H tokens)
    and cut the row's input to tokens [H - W, end) (run(replay_from=H) replays them). Returns (input_ids,
    attention_mask, replay_from [B] (0 for a row without a hit), the rows' prompts as token lists). Host
    work (token lists, hashing): it runs once per prompt, outside any captured graph."""
    window, pad_id = cache.window_size, model.model.text_config.engram_pad_token_id
    token_map, history = model.model.engram_token_map, cache.engram_history.shape[1]
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
    rows, replay_from = [], []
    for b, tokens in enumerate(prompts):
        state = store.lookup(tokens)
        if state is None:
            rows.append(tokens)
            replay_from.append(0)
            continue
        start = state.length - window
        before = [pad_id] * max(history - start, 0) + tokens[max(start - history, 0):start]
        restore(cache, b, state, token_map[torch.tensor(before, dtype=torch.long, device=token_map.device)])
        rows.append(tokens[start:])
        replay_from.append(state.length)
    width = max(len(r) for r in rows)
    ids = input_ids.new_full((len(rows), width), pad_id)
    mask = torch.zeros_like(ids)
    for b, tokens in enumerate(rows):
        ids[b, width - len(tokens):] = torch.tensor(tokens, dtype=ids.dtype)
        mask[b, width - len(tokens):] = 1
    return ids, mask, torch.tensor(replay_from, device=input_ids.device), prompts


def keep_prefixes(store: PrefixCache, cache, prompts: list[list[int]]) -> None:
    """After a prompt's prefill: keep each row's longest whole-block prefix beyond the window, unless the
    store already serves it (then copying the rows out would be wasted)."""
    for b, tokens in enumerate(prompts):
        length = len(tokens) // store.block_size * store.block_size
        if length > store.window and not store.holds(tokens[:length]):
            store.insert(tokens, snapshot(cache, b, length))
