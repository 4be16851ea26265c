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

from .hashing import BlockHasher, external_hash
from .index import PrefixIndex

DEFAULT_MEDIA: frozenset[str | None] = frozenset({"GPU", None})
"""The engine's own cache (vLLM names it GPU whatever the device)."""
POOL_MEDIA: frozenset[str | None] = frozenset({"CPU"})
"""The host KV pool (vLLM's offloading connector publishes its blocks as CPU)."""
TIER_MEDIA: frozenset[str | None] = frozenset({"STORAGE"})
"""The tier under the pool (``kv-offload-dir``: vLLM's file tier publishes STORAGE)."""


class KvEventDecodeError(DynagraphError):
    """A KV event frame or payload that is not what vLLM's publisher sends."""


# --- events (decoded straight from vLLM's msgpack; unknown fields are ignored) -------


class BlocksStored(msgspec.Struct, tag="BlockStored", frozen=True, gc=False):
    """Full blocks a worker added to its prefix cache, in chain order."""

    block_hashes: list[int]
    parent_hash: int | None = msgspec.field(default=None, name="parent_block_hash")
    block_size: int = 0
    medium: str | None = None
    group_idx: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None

    @property
    def has_extra_keys(self) -> bool:
        """True when LoRA / multimodal / salt keys went into the hashes."""
        return any(k is not None for k in self.extra_keys or ())


class BlocksStoredWithTokens(BlocksStored, tag="BlockStored", frozen=True, gc=False):
    """``BlocksStored`` plus the blocks' token ids (decoded only when asked for)."""

    token_ids: list[int] = []


class BlocksRemoved(msgspec.Struct, tag="BlockRemoved", frozen=True, gc=False):
    """Blocks a worker evicted."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class AllCleared(msgspec.Struct, tag="AllBlocksCleared", frozen=True, gc=False):
    """The worker dropped its whole prefix cache."""


KvEvent = BlocksStored | BlocksRemoved | AllCleared


class EventBatch(msgspec.Struct, frozen=True):
    """One published batch: ``seq`` increases by one per batch of one publisher."""

    topic: str
    seq: int
    ts: float
    dp_rank: int | None
    events: list[KvEvent]


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlocksStored | BlocksRemoved | AllCleared]
    data_parallel_rank: int | None = None


class _BatchWithTokens(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlocksStoredWithTokens | BlocksRemoved | AllCleared]
    data_parallel_rank: int | None = None


# Fallback for VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: hashes arrive as digest bytes.
class _BytesStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None
    group_idx: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class _BytesRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _BytesBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_BytesStored | _BytesRemoved | AllCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(_Batch)
_decoder_tokens = msgspec.msgpack.Decoder(_BatchWithTokens)
_decoder_bytes = msgspec.msgpack.Decoder(_BytesBatch)


def _from_bytes_batch(batch: _BytesBatch, with_tokens: bool) -> list[KvEvent]:
    events: list[KvEvent] = []
    for ev in batch.events:
        if isinstance(ev, _BytesStored):
            parent = ev.parent_block_hash
            common: dict[str, Any] = dict(
                block_hashes=[external_hash(h) for h in ev.block_hashes],
                parent_hash=None if parent is None else external_hash(parent),
                block_size=ev.block_size,
                medium=ev.medium,
                group_idx=ev.group_idx,
                lora_name=ev.lora_name,
                extra_keys=ev.extra_keys,
            )
            if with_tokens:
                events.append(BlocksStoredWithTokens(**common, token_ids=ev.token_ids))
            else:
                events.append(BlocksStored(**common))
        elif isinstance(ev, _BytesRemoved):
            events.append(
                BlocksRemoved(
                    block_hashes=[external_hash(h) for h in ev.block_hashes],
                    medium=ev.medium,
                    group_idx=ev.group_idx,
                )
            )
        else:
            events.append(ev)
    return events


def decode_payload(
    payload: bytes, *, with_tokens: bool = False
) -> tuple[float, int | None, list[KvEvent]]:
    """Decode one msgpack ``KVEventBatch`` payload into ``(ts, dp_rank, events)``.

    Token ids are skipped (the index does not need them) unless ``with_tokens``, in
    which case stored events are ``BlocksStoredWithTokens``.
    """
    try:
        try:
            batch = (_decoder_tokens if with_tokens else _decoder).decode(payload)
            return batch.ts, batch.data_parallel_rank, batch.events  # type: ignore[return-value]
        except msgspec.ValidationError:
            raw = _decoder_bytes.decode(payload)
            return raw.ts, raw.data_parallel_rank, _from_bytes_batch(raw, with_tokens)
    except msgspec.DecodeError as exc:
        raise KvEventDecodeError(f"not a vLLM KVEventBatch payload: {exc}") from exc


def decode_frames(frames: Sequence[bytes], *, with_tokens: bool = False) -> EventBatch:
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
    ts, dp_rank, events = decode_payload(bytes(payload), with_tokens=with_tokens)
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


def hashes_agree(hasher: BlockHasher, event: BlocksStoredWithTokens) -> bool | None:
    """Whether ``hasher`` reproduces a root event's hashes from its token ids.

    ``None`` when it cannot tell: the event continues a chain (its parent's full digest
    is not on the wire) or carries LoRA / multimodal / salt keys. A Router can check the
    first root event of each worker and refuse to route by a hash config that differs
    from the engine's (block size, ``prefix_caching_hash_algo``, ``PYTHONHASHSEED``).
    """
    if event.parent_hash is not None or event.has_extra_keys or event.lora_name:
        return None
    if event.block_size != hasher.block_size:
        return False
    return hasher.block_hashes(event.token_ids) == event.block_hashes


# --- the worker -> Router stream (a worker's ``kv_events`` endpoint) -----------------


class RelayBatch(msgspec.Struct, frozen=True):
    """One message of a ``kv_events`` stream (travels as a msgpack map).

    Apply in this order: if ``snapshot`` or ``cleared``, forget every block of the
    worker; then remove ``removed``; then add ``stored``. ``seq`` increases by one
    per live batch; a snapshot carries the seq of the last batch it includes.
    ``pooled_*``: the same for the worker's host KV pool (a snapshot or ``cleared``
    forgets its pooled blocks too); ``tiered_*`` for the blocks it wrote to the tier
    under its pool (``kv-offload-dir``), which the workers sharing that tier can load.
    """

    seq: int
    snapshot: bool = False
    cleared: bool = False
    stored: list[int] = []
    removed: list[int] = []
    pooled_stored: list[int] = []
    pooled_removed: list[int] = []
    tiered_stored: list[int] = []
    tiered_removed: list[int] = []

    def to_wire(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_wire(cls, data: Any) -> RelayBatch:
        return msgspec.convert(data, cls)

    def apply_to(self, index: PrefixIndex, worker_id: int,
                 pooled: PrefixIndex | None = None,
                 tiered: PrefixIndex | None = None) -> None:
        """Mirror this batch into ``index`` (the pool's blocks into ``pooled``, the
        tier's into ``tiered``) under ``worker_id``."""
        reset = self.snapshot or self.cleared
        _mirror(index, worker_id, reset, self.removed, self.stored)
        if pooled is not None:
            _mirror(pooled, worker_id, reset, self.pooled_removed, self.pooled_stored)
        if tiered is not None:
            _mirror(tiered, worker_id, reset, self.tiered_removed, self.tiered_stored)


def _mirror(index: PrefixIndex, worker_id: int, reset: bool, removed: list[int],
            stored: list[int]) -> None:
    if reset:
        index.clear_worker(worker_id)
    index.add_worker(worker_id)
    if removed:
        index.apply_removed(worker_id, removed)
    if stored:
        index.apply_stored(worker_id, None, stored)
