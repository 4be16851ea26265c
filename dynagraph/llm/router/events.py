"""Decode vLLM's ZMQ KV-cache event frames into small typed events, and apply them.

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) sends each batch as
three frames: ``topic`` (utf-8), ``seq`` (8 bytes big-endian; ``-1`` signed marks the
end of a replay), and a msgpack payload of ``KVEventBatch`` encoded by msgspec as an
array ``[ts, [event, ...], data_parallel_rank]``. Each event is a map tagged by
``"type"``: ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``. Block hashes are
64-bit ints by default, digest bytes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``;
both are normalised here to the 64-bit int key of :mod:`.hashing`.

Everything here is pure: bytes in, events out; events plus an index in, index updated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from dynagraph.errors import DynagraphError

from .hashing import external_hash
from .index import PrefixIndex

DEFAULT_MEDIA: frozenset[str | None] = frozenset({"GPU", None})


class KvEventDecodeError(DynagraphError):
    """A KV event frame or payload that is not what vLLM's publisher sends."""


# --- wire shapes (mirror vLLM's msgspec structs; unknown fields are ignored) ---------


class _WireStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _WireRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _WireCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_WireStored | _WireRemoved | _WireCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(_WireBatch)


# --- public events ---------------------------------------------------------------------


class BlocksStored(msgspec.Struct, frozen=True):
    """Full blocks a worker added to its prefix cache, in chain order."""

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    group_idx: int | None = None
    lora_name: str | None = None
    has_extra_keys: bool = False


class BlocksRemoved(msgspec.Struct, frozen=True):
    """Blocks a worker evicted."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class AllCleared(msgspec.Struct, frozen=True):
    """The worker dropped its whole prefix cache."""


KvEvent = BlocksStored | BlocksRemoved | AllCleared


class EventBatch(msgspec.Struct, frozen=True):
    """One published batch: ``seq`` increases by one per batch of one publisher."""

    topic: str
    seq: int
    ts: float
    dp_rank: int | None
    events: list[KvEvent]


def _ints(hashes: list[int | bytes]) -> list[int]:
    if all(type(h) is int for h in hashes):
        return hashes  # type: ignore[return-value]
    return [external_hash(h) for h in hashes]


def decode_payload(payload: bytes) -> tuple[float, int | None, list[KvEvent]]:
    """Decode one msgpack ``KVEventBatch`` payload into ``(ts, dp_rank, events)``."""
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventDecodeError(f"not a vLLM KVEventBatch payload: {exc}") from exc
    events: list[KvEvent] = []
    for ev in batch.events:
        if isinstance(ev, _WireStored):
            parent = ev.parent_block_hash
            events.append(
                BlocksStored(
                    block_hashes=_ints(ev.block_hashes),
                    parent_hash=None if parent is None else external_hash(parent),
                    token_ids=ev.token_ids,
                    block_size=ev.block_size,
                    medium=ev.medium,
                    group_idx=ev.group_idx,
                    lora_name=ev.lora_name,
                    has_extra_keys=any(k is not None for k in ev.extra_keys or ()),
                )
            )
        elif isinstance(ev, _WireRemoved):
            events.append(
                BlocksRemoved(
                    block_hashes=_ints(ev.block_hashes), medium=ev.medium, group_idx=ev.group_idx
                )
            )
        else:
            events.append(AllCleared())
    return batch.ts, batch.data_parallel_rank, events


def decode_frames(frames: Sequence[bytes]) -> EventBatch:
    """Decode the three ZMQ frames ``(topic, seq, payload)`` of one published batch."""
    if len(frames) != 3:
        raise KvEventDecodeError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise KvEventDecodeError(f"sequence frame must be 8 bytes, got {len(seq_bytes)}")
    try:
        topic_str = bytes(topic).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvEventDecodeError(f"topic frame is not utf-8: {exc}") from exc
    ts, dp_rank, events = decode_payload(bytes(payload))
    return EventBatch(
        topic=topic_str,
        seq=int.from_bytes(seq_bytes, "big", signed=True),
        ts=ts,
        dp_rank=dp_rank,
        events=events,
    )


def apply_events(
    index: PrefixIndex,
    worker_id: int,
    events: Iterable[KvEvent],
    *,
    media: frozenset[str | None] = DEFAULT_MEDIA,
    group_idx: int = 0,
) -> int:
    """Apply one worker's events to ``index`` in order; returns how many were applied.

    Events of another storage medium (e.g. a CPU offload tier) or another KV-cache
    group are skipped, since a request's prefill only reuses the primary cache.
    """
    applied = 0
    for ev in events:
        if isinstance(ev, AllCleared):
            index.clear_worker(worker_id)
        elif ev.medium not in media or (ev.group_idx or 0) != group_idx:
            continue
        elif isinstance(ev, BlocksStored):
            index.apply_stored(worker_id, ev.parent_hash, ev.block_hashes)
        else:
            index.apply_removed(worker_id, ev.block_hashes)
        applied += 1
    return applied
