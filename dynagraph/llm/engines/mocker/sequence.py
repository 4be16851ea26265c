"""One request inside the mocker: its tokens, block hashes, progress and output source.

Mirrors vLLM v1's ``Request``: ``token_ids`` is the prompt followed by the tokens
generated so far; ``num_computed_tokens`` is how many of them have KV in the cache;
the scheduler gives a request ``num_tokens - num_computed_tokens`` more tokens to
compute, and when a step brings it to ``num_tokens`` a new token is sampled. There is
no prefill or decode phase, only that catch-up (vLLM's own framing).

Block hashes are kept for every *full* block of ``token_ids`` (prompt and output),
extended as tokens are appended, so a preempted request finds its own blocks again.

Output tokens come from :class:`TokenSource`: deterministic, in ``[0, vocab_size)``,
never one of the excluded ids (EOS, the request's stop tokens). Same key, same tokens.
"""

from __future__ import annotations

import enum
import hashlib
import random
from array import array
from collections.abc import Iterable
from typing import Any

from dynagraph.errors import InvalidRequest
from dynagraph.llm.engines.base import FinishReason
from dynagraph.llm.router.hashing import BlockHasher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting-for-remote-kv"
    FINISHED = "finished"


def output_key(
    prompt: Iterable[int], *, engine_seed: int, request_id: str, temperature: float,
    seed: int | None,
) -> int:
    """The 64-bit key of a request's output tokens.

    Greedy requests (``temperature == 0``) depend on the prompt only, as a model's
    would; seeded ones on the prompt and the seed; others on the request id too.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(engine_seed.to_bytes(8, "little", signed=True))
    if temperature > 0:
        h.update(b"s" + (seed.to_bytes(8, "little", signed=True) if seed is not None
                         else b"r" + request_id.encode()))
    h.update(array("q", prompt).tobytes())
    return int.from_bytes(h.digest(), "little")


class TokenSource:
    """A deterministic stream of token ids avoiding ``excluded``."""

    __slots__ = ("_allowed", "_excluded", "_rng", "_vocab")

    def __init__(self, key: int, vocab_size: int, excluded: frozenset[int] = frozenset()) -> None:
        self._rng = random.Random(key)
        self._vocab = vocab_size
        self._excluded = excluded
        self._allowed: list[int] | None = None
        if sum(1 for t in excluded if 0 <= t < vocab_size) >= vocab_size:
            raise InvalidRequest("every token id of the vocabulary is a stop or EOS token")

    def next(self) -> int:
        rnd, vocab, excluded = self._rng.random, self._vocab, self._excluded
        for _ in range(16):
            t = int(rnd() * vocab)
            if t not in excluded:
                return t
        if self._allowed is None:  # a vocabulary mostly excluded: draw from what is left
            self._allowed = [t for t in range(self._vocab) if t not in excluded]
        return self._rng.choice(self._allowed)


class Sequence:
    """A request's state in the scheduler. Plain data; the scheduler mutates it."""

    __slots__ = (
        "_digests", "block_hashes", "cache_salt", "finish_reason", "hasher",
        "kv_transfer_params",
        "max_tokens", "num_cached_tokens", "num_computed_tokens", "num_preemptions",
        "num_prompt_tokens", "priority", "remote_decode", "remote_prefill", "request_id",
        "status", "token_ids", "tokens", "arrival",
    )

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        *,
        max_tokens: int,
        hasher: BlockHasher,
        tokens: TokenSource,
        remote_decode: bool = False,
        remote_prefill: dict[str, Any] | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        digests: list[bytes] | None = None,
    ) -> None:
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = max_tokens
        self.hasher = hasher
        self.tokens = tokens
        self.remote_decode = remote_decode
        """Prefill for a remote decode: keep the blocks when finished (vLLM P side)."""
        self.remote_prefill = remote_prefill
        """The producer's ``kv_transfer_params``: load the prompt's KV (vLLM D side)."""
        self.priority = priority
        """Lower is served first under the scheduler's ``priority`` policy (vLLM's)."""
        self.arrival = 0
        """Order of arrival at the scheduler (set by ``Scheduler.add``): breaks ties."""
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_cached_tokens = -1
        """Prompt tokens not computed here (prefix hit + transferred); set when admitted."""
        self.finish_reason: FinishReason | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        self.cache_salt = cache_salt
        """Goes into the first block's hash (as vLLM's ``cache_salt``): salted prefixes
        are shared only with the same salt."""
        self._digests: list[bytes] = (
            hasher.digests(self.token_ids, cache_salt=cache_salt) if digests is None
            else list(digests))
        """``digests``: the prompt's block digests when the caller already has them (a
        simulation that hashes each shared prefix once); they must equal these."""
        self.block_hashes: list[int] = [int.from_bytes(d[-8:], "big") for d in self._digests]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append_token(self, token: int) -> None:
        """Append a sampled token; hash the block it completes, if any."""
        tokens = self.token_ids
        tokens.append(token)
        bs = self.hasher.block_size
        if len(tokens) % bs == 0:
            if self._digests:
                digest = self.hasher.hash_block(self._digests[-1], tokens[-bs:])
            else:  # the first block carries the salt
                digest = self.hasher.digests(tokens[-bs:], cache_salt=self.cache_salt)[0]
            self._digests.append(digest)
            self.block_hashes.append(int.from_bytes(digest[-8:], "big"))

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
