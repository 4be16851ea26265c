"""Prompt token ids for trace requests, which carry block ids instead of text.

Every trace block id stands for ``trace_block_size`` token ids drawn deterministically
from the id alone (SHAKE-256 of the id), so two requests that share leading ids share
leading tokens, and the engines' ``BlockHasher`` and the Router's index see the same
prefix sharing the trace describes; different ids give different tokens (a collision of
one engine block needs 16+ equal 16-bit draws). A request's last block may be partial:
its tokens are the first ones of its id's block.

The engine's block digests of a prompt are also computed here, once per shared prefix:
where the trace block size is a multiple of the engine's, the digests of a block id
that the trace uses again (``shared``) are kept, keyed by (parent digest, id), until
its last use. They are the ``BlockHasher``'s own, so nothing downstream can tell.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from dynagraph.llm.router.hashing import BlockHasher

from .trace import TraceRequest

_DIGEST = 32


class Prompt(NamedTuple):
    """A request's prompt token ids and the engine's digests of its full blocks."""

    token_ids: list[int]
    digests: list[bytes]


def block_tokens(hash_id: int, size: int, vocab_size: int) -> list[int]:
    """The ``size`` token ids that trace block ``hash_id`` stands for, in ``[0, vocab)``."""
    raw = np.frombuffer(hashlib.shake_256(hash_id.to_bytes(8, "little")).digest(2 * size),
                        dtype="<u2")
    if vocab_size < 1 << 16:
        raw = raw % vocab_size
    out: list[int] = raw.tolist()
    return out


def shared_ids(requests: Iterable[TraceRequest]) -> Counter[int]:
    """How many requests use each block id that more than one request uses."""
    uses: Counter[int] = Counter()
    for r in requests:
        uses.update(r.hash_ids)
    return Counter({h: n for h, n in uses.items() if n > 1})


class PromptBuilder:
    """Builds :class:`Prompt` values for trace requests (see the module docstring).

    ``shared`` counts the uses of the block ids worth remembering (:func:`shared_ids`);
    each :meth:`prompt` call counts one use of each of its ids.
    """

    def __init__(self, hasher: BlockHasher, *, trace_block_size: int, vocab_size: int,
                 shared: Counter[int] | None = None) -> None:
        self.hasher = hasher
        self.trace_block_size = trace_block_size
        self.vocab_size = vocab_size
        self._aligned = trace_block_size % hasher.block_size == 0
        self._left: Counter[int] = Counter(shared or {})
        self._memo: dict[tuple[bytes, int], bytes] = {}

    def prompt(self, request: TraceRequest) -> Prompt:
        bs = self.trace_block_size
        n = request.input_length
        tokens: list[int] = []
        for h in request.hash_ids:
            tokens += block_tokens(h, bs, self.vocab_size)
        del tokens[n:]
        if not self._aligned:
            return Prompt(tokens, self.hasher.digests(tokens))
        digests: list[bytes] = []
        parent = self.hasher.none_hash
        per_block = bs // self.hasher.block_size
        for i, h in enumerate(request.hash_ids):
            full = min(n - i * bs, bs) // self.hasher.block_size
            chunk = self._block_digests(parent, h, tokens[i * bs:(i + 1) * bs], per_block)
            got = [chunk[j * _DIGEST:(j + 1) * _DIGEST] for j in range(full)]
            digests += got
            if got:
                parent = got[-1]
        return Prompt(tokens, digests)

    def _block_digests(self, parent: bytes, hash_id: int, tokens: list[int],
                       per_block: int) -> bytes:
        """The concatenated digests of the engine blocks of ``tokens`` after ``parent``."""
        left = self._left.get(hash_id, 0)
        if left <= 0:
            return b"".join(self.hasher.digests(tokens, parent))
        key = (parent, hash_id)
        if left == 1:
            self._left.pop(hash_id)
            got = self._memo.pop(key, None)
        else:
            self._left[hash_id] = left - 1
            got = self._memo.get(key)
        if got is None:
            full = block_tokens(hash_id, self.trace_block_size, self.vocab_size)
            got = b"".join(self.hasher.digests(full, parent))
            if left > 1:
                self._memo[key] = got
        return got
