"""Token-id side of Engram (MODEL.md section 3.1-3.3).

Three pieces, all independent of the model weights:

* the compressed vocabulary: token id -> compressed id (``build_token_map`` / ``load_token_map``);
* the hash parameters of each Engram layer: odd multipliers, distinct primes and table offsets
  (``derive_hash_params``);
* the n-gram hash itself, in pure torch so it can run inside the model's forward
  (``engram_hash_ids``), plus the 3-token history that lets chunked prefill and decode produce the
  same ids as a one-shot forward (``initial_history`` / ``update_history``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TOKEN_MAP_FILE = "engram_token_map.safetensors"
TOKENIZER_FILE = "tokenizer.json"

# Seed stride of the per-layer multiplier generator (numpy.random.default_rng(10007 * layer_id)).
_SEED_STRIDE = 10007
_INT64_MAX = int(np.iinfo(np.int64).max)


# --------------------------------------------------------------------------------------------
# 3.1 Compressed vocabulary
# --------------------------------------------------------------------------------------------


def _key_normalizers():
    """(collapse, strip) normalizers of the `tokenizers` library.

    The strip step is kept separate because a token whose collapsed text is exactly one space must
    stay one space instead of being stripped to nothing.
    """
    from tokenizers import Regex, normalizers

    collapse = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        ]
    )
    return collapse, normalizers.Strip()


def build_token_map(tokenizer_json_path: str | Path) -> torch.Tensor:
    """Token id -> compressed id, int64 [vocab], built from a `tokenizer.json`.

    Each id is decoded on its own with the raw `tokenizers` backend (special tokens kept) and keyed
    by its normalized text. Details that matter for matching the reference:

    * a decoded text containing U+FFFD (a partial UTF-8 byte) is keyed by its raw token string;
    * a text that normalizes to nothing (e.g. a lone combining accent) is keyed by its decoded text,
      so such tokens do NOT all collapse into one id (the fixture's ids 15/16 check this);
    * equal keys share one id; ids are numbered in order of first appearance by token id.

    The vocab covers added tokens: its size is the largest id (base vocab or added) + 1. An id with
    no token (a gap in the vocab) decodes to "" and is keyed like any other token.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json_path))
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(max(vocab.values()) + 1, tok.get_vocab_size(with_added_tokens=True))
    collapse, strip = _key_normalizers()

    key_to_id: dict[str, int] = {}
    out = torch.empty(size, dtype=torch.int64)
    for tid in range(size):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid) or text
        else:
            collapsed = collapse.normalize_str(text)
            key = collapsed if collapsed == " " else strip.normalize_str(collapsed)
            if not key:
                key = text
        out[tid] = key_to_id.setdefault(key, len(key_to_id))
    return out


def load_token_map(folder: str | Path) -> torch.Tensor:
    """The token map of a model folder: the shipped `engram_token_map.safetensors` (key
    `token_map`) if present, else built from the folder's `tokenizer.json`."""
    folder = Path(folder)
    shipped = folder / TOKEN_MAP_FILE
    if shipped.is_file():
        from safetensors.torch import load_file

        return load_file(str(shipped))["token_map"].to(torch.int64)
    tokenizer_json = folder / TOKENIZER_FILE
    if tokenizer_json.is_file():
        return build_token_map(tokenizer_json)
    raise FileNotFoundError(
        f"Engram needs a compressed token map, but {folder} has neither {TOKEN_MAP_FILE} "
        f"(key 'token_map') nor {TOKENIZER_FILE} to build it from."
    )


# --------------------------------------------------------------------------------------------
# 3.3 Hash parameters
# --------------------------------------------------------------------------------------------


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin; these bases are exact for every n < 3.3e24 (covers int64)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class EngramHashParams:
    """Per Engram layer (index i into `layer_ids`):

    multipliers[i]: `max_ngram_size` odd int64 multipliers, one per look-back 0..max-1;
    primes[i][g][h]: modulus of n-gram size g+2, head h;
    offsets[i][col]: table offset of column col = g * n_heads + h (exclusive cumsum of primes).
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    pad_compressed_id: int
    multipliers: tuple[tuple[int, ...], ...]
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]

    @property
    def n_ngrams(self) -> int:
        return self.max_ngram_size - 1

    @property
    def n_cols(self) -> int:
        return self.n_ngrams * self.n_heads

    @property
    def history_len(self) -> int:
        return self.max_ngram_size - 1

    @property
    def table_rows(self) -> tuple[int, ...]:
        return tuple(sum(sum(g) for g in layer) for layer in self.primes)

    def flat_primes(self, layer_index: int) -> tuple[int, ...]:
        return tuple(p for g in self.primes[layer_index] for p in g)


def derive_hash_params(
    layer_ids,
    max_ngram_size: int,
    n_heads: int,
    engram_vocab_size: int,
    compressed_vocab_size: int,
    pad_compressed_id: int,
) -> EngramHashParams:
    """Multipliers, primes and offsets of every Engram layer (MODEL.md 3.3).

    Primes: every (layer, n-gram size, head) gets a distinct prime. Each n-gram size restarts its
    search at `engram_vocab_size - 1` and walks up to the smallest prime not yet taken; within an
    n-gram size the search continues from the previous head's prime. Because every prime already
    taken is skipped, the restart is equivalent to continuing (the fixture's primes are consecutive).
    """
    layer_ids = tuple(int(x) for x in layer_ids)
    # Bound keeps c * m inside int64 for every compressed id c < compressed_vocab_size.
    bound = (_INT64_MAX // int(compressed_vocab_size)) // 2
    taken: set[int] = set()
    multipliers, primes, offsets = [], [], []
    for layer_id in layer_ids:
        rng = np.random.default_rng(_SEED_STRIDE * layer_id)
        u = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64)
        multipliers.append(tuple(int(2 * x + 1) for x in u))

        layer_primes = []
        for _n in range(2, max_ngram_size + 1):
            cur = engram_vocab_size - 1
            heads = []
            for _h in range(n_heads):
                cur += 1
                while cur in taken or not _is_prime(cur):
                    cur += 1
                taken.add(cur)
                heads.append(cur)
            layer_primes.append(tuple(heads))
        primes.append(tuple(layer_primes))

        flat = [p for g in layer_primes for p in g]
        offsets.append(tuple(int(x) for x in np.concatenate([[0], np.cumsum(flat)[:-1]])))
    return EngramHashParams(
        layer_ids=layer_ids,
        max_ngram_size=int(max_ngram_size),
        n_heads=int(n_heads),
        pad_compressed_id=int(pad_compressed_id),
        multipliers=tuple(multipliers),
        primes=tuple(primes),
        offsets=tuple(offsets),
    )


# --------------------------------------------------------------------------------------------
# 3.2-3.3 Hash ids (pure torch)
# --------------------------------------------------------------------------------------------


def initial_history(batch: int, params: EngramHashParams, device=None) -> torch.Tensor:
    """History of a fresh sequence: every look-back before position 0 is the pad compressed id."""
    return torch.full(
        (batch, params.history_len), params.pad_compressed_id, dtype=torch.int64, device=device
    )


def update_history(history: torch.Tensor, compressed_ids: torch.Tensor) -> torch.Tensor:
    """History after consuming `compressed_ids` [B, T]: the last `history_len` compressed ids,
    newest last (older ones come from the previous history when T is short)."""
    k = history.shape[1]
    return torch.cat([history, compressed_ids.to(history.dtype)], dim=1)[:, -k:] if k else history


def padding_first(history: torch.Tensor, compressed_ids: torch.Tensor, padding: torch.Tensor):
    """A chunk left-padded by `padding[b]` columns after cached tokens: move the padding in front of the
    history, so each real token's look-backs reach the history and the updated history ends with real
    tokens. Returns (history, compressed_ids) whose concatenation is [padding, history, real tokens];
    real tokens keep their columns. Without padding this returns the inputs' values unchanged."""
    k = history.shape[1]
    if k == 0:
        return history, compressed_ids
    ext = torch.cat([history, compressed_ids.to(history.dtype)], dim=1)
    col = torch.arange(ext.shape[1], device=ext.device)
    pad = padding.unsqueeze(1)
    ext = ext.gather(1, torch.where(col < pad, k + col, torch.where(col < pad + k, col - pad, col)))
    return ext[:, :k], ext[:, k:]


@functools.lru_cache(maxsize=64)
def _layer_constants(params: EngramHashParams, layer_index: int, device: torch.device):
    """Multipliers, primes and offsets of one layer as int64 tensors on `device`, made once: a host-to-
    device copy per forward would also be illegal inside a CUDA-graph capture."""
    return tuple(torch.tensor(values, dtype=torch.int64, device=device) for values in (
        params.multipliers[layer_index], params.flat_primes(layer_index), params.offsets[layer_index]))


def engram_hash_ids(
    compressed_ids: torch.Tensor,
    history: torch.Tensor,
    params: EngramHashParams,
    layer_index: int,
) -> torch.Tensor:
    """Hash ids [B, T, n_ngrams * n_heads] int64 of one Engram layer (`layer_index` indexes
    `params.layer_ids`).

    compressed_ids: [B, T] compressed ids of this chunk. history: [B, max_ngram_size - 1] compressed
    ids of the tokens before the chunk, newest last (pad-filled at sequence start).

    h_2 = c_p*m0 ^ c_{p-1}*m1, h_n = h_{n-1} ^ c_{p-n+1}*m_{n-1}; column (g, h) = h_{g+2} mod P + O.
    int64 multiply wraps like numpy's; `remainder` is the non-negative (numpy/Python) mod. With the
    multiplier bound and in-range ids the products never overflow, so h >= 0 anyway.
    """
    k = params.history_len
    t = compressed_ids.shape[1]
    dev = compressed_ids.device
    ext = torch.cat([history[:, -k:].to(torch.int64), compressed_ids.to(torch.int64)], dim=1)
    mult, primes, offsets = _layer_constants(params, layer_index, dev)

    # every n-gram's hash at once, look-back i XORed into the n-grams that reach it (XOR with 0 keeps a hash): one
    # broadcast expression, which a compiled set-up runs as one kernel (a stack of the running hashes was one each)
    reach = torch.arange(2, params.max_ngram_size + 1, device=dev)  # [n_ngrams]: the n-grams' lengths
    hashes = (ext[:, k:] * mult[0]).unsqueeze(-1).expand(-1, -1, reach.numel())  # look-back 0 = the token itself
    for i in range(1, params.max_ngram_size):  # loop over look-backs (3), not tokens
        hashes = hashes ^ torch.where(reach > i, (ext[:, k - i : k - i + t] * mult[i]).unsqueeze(-1), 0)
    hashes = hashes.repeat_interleave(params.n_heads, dim=-1)  # [B, T, n_ngrams * n_heads]
    return torch.remainder(hashes, primes) + offsets
