"""Trace records -> token-id prompts: each hash id is one fixed block of token ids.

A block's tokens are a pure function of ``(seed, hash id, block_tokens, vocabulary
range)`` (BLAKE2b in counter mode, so they never change with Python or library
versions): equal hash ids give equal blocks, so equal ``hash_ids`` prefixes give equal
token prefixes, and a serving system's prefix cache sees exactly the reuse the trace
describes. The prompt of a record is its blocks concatenated, cut to ``input_length``.

Ids are drawn uniformly from ``[lo, hi)``, a range of ordinary tokens of the served model
(:func:`safe_token_range` finds one from a ``tokenizer.json``); prompts are sent as token
ids, so no text round trip can change them.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path

from benchmarks.traces.trace import DEFAULT_BLOCK_TOKENS, TraceRecord, expected_blocks


def safe_token_range(tokenizer_dir: str | Path) -> tuple[int, int]:
    """The longest run ``[lo, hi)`` of vocabulary ids that are not special/added tokens.

    Reads ``tokenizer.json`` (Hugging Face ``tokenizers`` format): the model's vocabulary
    minus every id in ``added_tokens``. For the local tiny-llama (vocab 2048, ids 0-4
    special) this is ``(5, 2048)``.
    """
    path = Path(tokenizer_dir) / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        ids = set(vocab.values())
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids = set(range(len(vocab)))
    else:
        raise ValueError(f"{path}: no model.vocab to read token ids from")
    special = {int(t["id"]) for t in data.get("added_tokens", [])}
    usable = sorted(ids - special)
    best = (0, 0)
    start = prev = None
    for i in usable:
        if start is None or prev is None or i != prev + 1:
            start = i
        prev = i
        if i + 1 - start > best[1] - best[0]:
            best = (start, i + 1)
    if best[1] - best[0] < 2:
        raise ValueError(f"{path}: no usable range of ordinary token ids")
    return best


class PromptSynthesizer:
    """Builds token-id prompts for trace records (see the module docstring).

    ``cache_blocks`` bounds the memory of recently built blocks (LRU); a block is cheap to
    rebuild (~0.1 ms for 512 tokens), the cache only saves time on shared prefixes.
    """

    def __init__(self, *, lo: int, hi: int, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 seed: int = 0, cache_blocks: int = 4096) -> None:
        if not 0 <= lo < hi:
            raise ValueError(f"token range [{lo}, {hi}) is empty or negative")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.lo, self.hi, self.block_tokens, self.seed = lo, hi, block_tokens, seed
        self._cache: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._cache_blocks = cache_blocks

    def block(self, hash_id: int) -> tuple[int, ...]:
        """The ``block_tokens`` token ids of ``hash_id``."""
        cached = self._cache.get(hash_id)
        if cached is not None:
            self._cache.move_to_end(hash_id)
            return cached
        span = self.hi - self.lo
        key = f"{self.seed}:{self.lo}:{self.hi}:{self.block_tokens}:{hash_id}".encode()
        out: list[int] = []
        counter = 0
        while len(out) < self.block_tokens:
            digest = hashlib.blake2b(key + b"|" + counter.to_bytes(8, "little"),
                                     person=b"dynagraph-trace").digest()
            # 8 bytes per token: the modulo bias is below 2**-40 for any vocabulary.
            for i in range(0, len(digest), 8):
                out.append(self.lo + int.from_bytes(digest[i:i + 8], "little") % span)
            counter += 1
        block = tuple(out[: self.block_tokens])
        self._cache[hash_id] = block
        if len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return block

    def prompt(self, record: TraceRecord) -> list[int]:
        """The record's prompt: its blocks in order, cut to exactly ``input_length``."""
        want = expected_blocks(record.input_length, self.block_tokens)
        if len(record.hash_ids) != want:
            raise ValueError(f"{len(record.hash_ids)} hash ids for input_length "
                             f"{record.input_length}; block_tokens {self.block_tokens} "
                             f"needs {want}")
        ids: list[int] = []
        for h in record.hash_ids:
            ids.extend(self.block(h))
        del ids[record.input_length:]
        return ids
