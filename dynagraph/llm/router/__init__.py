"""KV-aware routing: pure pieces the Router component is built from.

    hashing  BlockHasher          token ids -> vLLM's chained block hashes (64-bit)
    events   decode_frames/...    vLLM ZMQ KV event frames -> typed events -> index
    index    PrefixIndex          block hash -> bitmask of workers; find_matches
    cost     choose_worker        overlaps + loads + request length + speeds + RNG -> Decision
    rates    RateLearner          a worker's speeds, learned from its load samples
    pending  WorkerQueue          the Router's forecast of a worker's prefill queue
    state    RouterState          the index, loads, speeds and in-flight requests; decide()
    replicas InflightFeed/...     Router replicas sharing their in-flight requests

No I/O anywhere here: the component owns sockets, discovery and metrics.
"""

from __future__ import annotations

from .cost import CostModel, Decision, RouterMode, WorkerLoad, choose_worker, predicted_ttft
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
from .pending import WorkerQueue
from .rates import RateLearner, RatePriors, RobustEwma, WorkerRates
from .state import RouteDecision, RouteRequest, RouterState

__all__ = [
    "AllCleared",
    "BlockHasher",
    "BlocksRemoved",
    "BlocksStored",
    "BlocksStoredWithTokens",
    "CostModel",
    "Decision",
    "EventBatch",
    "IndexStats",
    "KvEvent",
    "KvEventDecodeError",
    "PrefixIndex",
    "RateLearner",
    "RatePriors",
    "RelayBatch",
    "RouteDecision",
    "RouteRequest",
    "RouterState",
    "RouterMode",
    "RobustEwma",
    "WorkerLoad",
    "WorkerQueue",
    "WorkerRates",
    "apply_events",
    "choose_worker",
    "decode_frames",
    "decode_payload",
    "external_hash",
    "hashes_agree",
    "predicted_ttft",
    "seed_from_env",
]
