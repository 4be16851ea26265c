"""Simulated KV transfers between mocker engines: who holds what, and who frees it.

No KV data exists, so nothing moves; what is simulated is the *time* and the *block
lifetimes* of vLLM's NixlConnector hand-off:

1. A prefill engine given ``kv_transfer_params={"do_remote_decode": true}`` prefills,
   keeps the request's blocks when it finishes and returns ``kv_transfer_params``
   (``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
   ``remote_block_hashes``, ``remote_num_tokens``, ...) on its last output. It holds
   the blocks until told they were fetched, or until its lease (``kv-lease-seconds``,
   scaled by ``speed`` like every simulated duration) runs out.
2. A decode engine given those params looks up its own prefix cache, allocates blocks
   for the prompt and waits ``latency + bytes / bandwidth`` for the rest (``bytes`` =
   tokens not cached locally x the profile's ``kv_bytes_per_token``; transfers into
   one engine queue on one link, like one NIC), then caches the blocks and decodes.
3. When its transfer completes (or the request is aborted) the decode engine tells the
   producer through a :class:`KvTransferRegistry`: the producer frees the blocks.

The registry is a directory of producers *in this process*, by engine id. Engines in
different processes do not find each other in it; then the producer's lease frees the
blocks (a component can forward the notification over its own transport by calling
the producer's ``release_transfer``). ``process_registry()`` is the default instance
every engine of a process shares unless one is injected.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

log = logging.getLogger(__name__)


class KvProducer(Protocol):
    """What the registry needs from a producing engine."""

    def release_transfer(self, request_id: str) -> bool:
        """Free the blocks held for ``request_id``; False when none are held."""
        ...


class KvTransferRegistry:
    """Producers by engine id. Not thread-safe: one event loop per process uses it."""

    def __init__(self) -> None:
        self._producers: dict[str, KvProducer] = {}

    def register(self, engine_id: str, producer: KvProducer) -> None:
        other = self._producers.get(engine_id)
        if other is not None and other is not producer:
            raise ValueError(f"engine id {engine_id!r} is already registered in this process")
        self._producers[engine_id] = producer

    def unregister(self, engine_id: str, producer: KvProducer) -> None:
        if self._producers.get(engine_id) is producer:
            del self._producers[engine_id]

    def fetched(self, engine_id: str, request_id: str) -> bool:
        """Tell producer ``engine_id`` that ``request_id``'s blocks were read (or are no
        longer wanted). False when the producer is not in this process or holds nothing."""
        producer = self._producers.get(engine_id)
        if producer is None:
            log.debug("producer %s is not in this process; its lease frees %s",
                      engine_id, request_id)
            return False
        return producer.release_transfer(request_id)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._producers


@functools.cache
def process_registry() -> KvTransferRegistry:
    """The registry shared by the mocker engines of this process."""
    return KvTransferRegistry()


def transfer_seconds(num_bytes: int, bandwidth_gbps: float, latency_s: float) -> float:
    """How long moving ``num_bytes`` takes: ``latency + bytes / (bandwidth x 1e9)``
    (bandwidth in GB/s; 0 means instant)."""
    if bandwidth_gbps <= 0:
        return latency_s
    return latency_s + num_bytes / (bandwidth_gbps * 1e9)
