"""Block hashing: the one place that turns token ids into the engine's block hashes.

The router's index is keyed by the hashes vLLM itself publishes in ``BlockStored``
events, and a query is keyed by the same hashes computed here from the request's
token ids. So the index needs no per-worker translation table, and a hit means
exactly what a vLLM prefix-cache hit means.

How vLLM (0.32, ``vllm/v1/core/kv_cache_utils.py``) hashes a block, for requests
without LoRA, multimodal inputs, prompt embeddings or ``cache_salt``::

    NONE_HASH  = H(seed)                                   # seed is a str
    block_i    = H((parent, tuple(tokens_of_block_i), None))  # parent = block_{i-1} or NONE_HASH

where ``H`` is ``--prefix-caching-hash-algo`` (default ``sha256`` = SHA-256 of
``pickle.dumps(x, protocol=HIGHEST_PROTOCOL)``; ``sha256_cbor`` = SHA-256 of canonical
CBOR). Only full blocks are hashed. The seed is ``PYTHONHASHSEED`` when that is set
in the engine's environment, else the fixed string ``"vllm-none-hash"`` for the
SHA-256 algorithms. (The ``xxhash`` algorithms draw a random per-process seed unless
``PYTHONHASHSEED`` is set: an engine run that way cannot be routed by hash; this
module refuses ``xxhash`` without an explicit seed.)

Events carry ``ExternalBlockHash`` values: by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) the low 64 bits of the digest read
big-endian, else the raw digest bytes. :func:`external_hash` maps either form to the
64-bit int the index uses.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dynagraph.errors import ConfigError

HashAlgo = Literal["sha256", "sha256_cbor"]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # a vLLM dependency; only needed for this algorithm

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
}


def seed_from_env(env: Mapping[str, str]) -> str:
    """The NONE_HASH seed an engine started with environment ``env`` uses (SHA-256 algos)."""
    return env.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def external_hash(block_hash: bytes | int) -> int:
    """Map an engine hash (digest bytes, or an event's int) to the index's 64-bit key."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash, "big") & _MASK64


@dataclass(frozen=True)
class BlockHasher:
    """Computes vLLM's chained block hashes for plain token sequences.

    ``block_size`` must equal the engine's block size, ``algo`` its
    ``prefix_caching_hash_algo`` and ``seed`` its NONE_HASH seed (see
    :func:`seed_from_env`). Thread-safe; cheap to construct.

    ``cached_blocks`` > 0 keeps the digests of that many recent blocks, keyed by what
    is hashed (the parent's digest, the block's tokens, its extra keys): a prefix that
    comes again (the point of prefix routing) is looked up instead of pickled and
    hashed again. The digests are the same either way.
    """

    block_size: int
    algo: HashAlgo = "sha256"
    seed: str = DEFAULT_NONE_HASH_SEED
    cached_blocks: int = field(default=0, compare=False)
    none_hash: bytes = field(init=False, repr=False)
    _fn: Callable[[Any], bytes] = field(init=False, repr=False, compare=False)
    _cache: OrderedDict[tuple[Any, ...], bytes] = field(
        init=False, repr=False, compare=False, default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        fn = _HASH_FNS.get(self.algo)
        if fn is None:
            raise ConfigError(
                f"unsupported prefix caching hash algo {self.algo!r}; use one of "
                f"{sorted(_HASH_FNS)} (xxhash seeds randomly per engine process)",
                key="prefix_caching_hash_algo",
            )
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "none_hash", fn(self.seed))

    def hash_block(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        """The full digest of one full block whose predecessor's digest is ``parent``."""
        return self._fn((parent or self.none_hash, tuple(tokens), None))

    def digests(self, token_ids: Sequence[int], parent: bytes | None = None, *,
                cache_salt: str | None = None) -> list[bytes]:
        """Digests of every full block of ``token_ids`` (a trailing partial block is ignored).

        ``cache_salt`` (a request's, as vLLM takes it) goes into the first block's extra
        keys, so a salted prefix never matches an unsalted or differently salted one.
        """
        bs = self.block_size
        fn = self._fn
        prev = parent or self.none_hash
        extra: tuple[Any, ...] | None = (
            (("cache_salt", cache_salt),) if cache_salt and parent is None else None)
        out: list[bytes] = []
        limit = self.cached_blocks
        if not limit:
            for start in range(0, len(token_ids) - bs + 1, bs):
                prev = fn((prev, tuple(token_ids[start : start + bs]), extra))
                extra = None
                out.append(prev)
            return out
        cache = self._cache
        for start in range(0, len(token_ids) - bs + 1, bs):
            key = (prev, tuple(token_ids[start : start + bs]), extra)
            digest = cache.get(key)
            if digest is None:
                digest = cache[key] = fn(key)
                if len(cache) > limit:  # the oldest entry goes
                    cache.popitem(last=False)
            prev = digest
            extra = None
            out.append(prev)
        return out

    def block_hashes(self, token_ids: Sequence[int], parent: bytes | None = None, *,
                     cache_salt: str | None = None) -> list[int]:
        """The 64-bit hashes vLLM's events report for the full blocks of ``token_ids``.

        This is the router's query key: ``PrefixIndex.find_matches(hasher.block_hashes(ids))``.
        """
        return [int.from_bytes(d, "big") & _MASK64
                for d in self.digests(token_ids, parent, cache_salt=cache_salt)]

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size
