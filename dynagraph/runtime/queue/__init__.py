"""The remote-prefill work queue: decode workers enqueue, prefill workers pull.

``NatsPrefillQueue`` is the real one (NATS JetStream); ``MemoryPrefillQueue`` has the
same delivery semantics in memory for unit tests. Both satisfy ``PrefillQueue``; see
``base`` for the contract (at-least-once delivery, ack_wait, max_deliver, max_age,
per-job deadline, and what ``depth()`` counts).
"""

from __future__ import annotations

from dynagraph.runtime.queue.base import (
    CONSUMER_NAME,
    PrefillQueue,
    PrefillQueueError,
    QueueItem,
    QueueStats,
    stream_name,
    subject_name,
)
from dynagraph.runtime.queue.job import (
    PrefillSampling,
    RemotePrefillJob,
    ReplyTarget,
    decode_job,
    encode_job,
)
from dynagraph.runtime.queue.memory import MemoryPrefillQueue, MemoryQueueItem
from dynagraph.runtime.queue.nats_queue import NatsPrefillQueue, NatsQueueItem

__all__ = [
    "CONSUMER_NAME",
    "MemoryPrefillQueue",
    "MemoryQueueItem",
    "NatsPrefillQueue",
    "NatsQueueItem",
    "PrefillQueue",
    "PrefillQueueError",
    "PrefillSampling",
    "QueueItem",
    "QueueStats",
    "RemotePrefillJob",
    "ReplyTarget",
    "decode_job",
    "encode_job",
    "stream_name",
    "subject_name",
]
