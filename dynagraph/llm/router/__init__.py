"""KV-aware routing: pure pieces the Router component is built from.

    hashing  BlockHasher          token ids -> vLLM's chained block hashes (64-bit)
    events   decode_frames/...    vLLM ZMQ KV event frames -> typed events -> index
    index    PrefixIndex          block hash -> bitmask of workers; find_matches
    cost     choose_worker        overlaps + loads + request length + RNG -> Decision
    state    RouterState          the index, loads and in-flight requests; decide()

No I/O anywhere here: the component owns sockets, discovery and metrics.
"""

from __future__ import annotations

from .cost import Decision, RouterMode, WorkerLoad, choose_worker
from .events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    BlocksStoredWithTokens,
    EventBatch,
    KvEvent,
    KvEventDecodeError,
    RelayBatch,
    apply_events,
    decode_frames,
    decode_payload,
    hashes_agree,
)
from .hashing import BlockHasher, external_hash, seed_from_env
from .index import IndexStats, PrefixIndex
from .state import RouteDecision, RouteRequest, RouterState

__all__ = [
    "AllCleared",
    "BlockHasher",
    "BlocksRemoved",
    "BlocksStored",
    "BlocksStoredWithTokens",
    "Decision",
    "EventBatch",
    "IndexStats",
    "KvEvent",
    "KvEventDecodeError",
    "PrefixIndex",
    "RelayBatch",
    "RouteDecision",
    "RouteRequest",
    "RouterState",
    "RouterMode",
    "WorkerLoad",
    "apply_events",
    "choose_worker",
    "decode_frames",
    "decode_payload",
    "external_hash",
    "hashes_agree",
    "seed_from_env",
]
