from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dynagraph.llm.router.events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    BlocksStoredWithTokens,
    KvEventDecodeError,
    apply_events,
    decode_frames,
    decode_payload,
    hashes_agree,
)
from dynagraph.llm.router.hashing import BlockHasher
from dynagraph.llm.router.index import PrefixIndex

# --- copies of vLLM 0.32's wire structs (vllm/distributed/kv_events.py) ---------------


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(_Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def frames(batch: KVEventBatch, seq: int = 7, topic: str = "kv") -> list[bytes]:
    payload = msgspec.msgpack.Encoder().encode(batch)
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


def stored(hashes: list[int | bytes], parent: int | bytes | None = None, **kw: Any) -> BlockStored:
    args: dict[str, Any] = dict(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(32 * len(hashes))),
        block_size=32,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )
    args.update(kw)
    return BlockStored(**args)


def test_decode_frames_round_trip() -> None:
    batch = KVEventBatch(
        ts=12.5,
        events=[
            stored([1, 2], session_id="s1", kv_cache_spec_kind="full"),
            stored([3], parent=2),
            BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    got = decode_frames(frames(batch, seq=42))
    assert (got.topic, got.seq, got.ts, got.dp_rank) == ("kv", 42, 12.5, 0)
    assert got.events == [
        BlocksStored([1, 2], None, 32, "GPU", 0),
        BlocksStored([3], 2, 32, "GPU", 0),
        BlocksRemoved([1], "GPU", 0),
        AllCleared(),
    ]
    with_tokens = decode_frames(frames(batch), with_tokens=True).events
    assert with_tokens[1] == BlocksStoredWithTokens([3], 2, 32, "GPU", 0, token_ids=list(range(32)))
    assert isinstance(with_tokens[1], BlocksStored)


def test_bytes_hashes_become_64_bit_ints() -> None:
    digest = bytes(range(32))
    low64 = int.from_bytes(digest[-8:], "big")
    payload = msgspec.msgpack.encode(
        KVEventBatch(
            ts=0.0,
            events=[
                stored([digest], parent=digest),
                BlockRemoved(block_hashes=[digest], medium="GPU"),
                AllBlocksCleared(),
            ],
        )
    )
    _, dp_rank, events = decode_payload(payload)
    assert dp_rank is None
    assert events == [
        BlocksStored([low64], low64, 32, "GPU", 0),
        BlocksRemoved([low64], "GPU"),
        AllCleared(),
    ]
    (ev, _, _) = decode_payload(payload, with_tokens=True)[2]
    assert isinstance(ev, BlocksStoredWithTokens) and ev.token_ids == list(range(32))


def test_extra_keys_and_lora_are_flagged() -> None:
    ev = stored([1], lora_name="adapter", lora_id=3, extra_keys=[("adapter",)])
    (got,) = decode_payload(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[ev])))[2]
    assert isinstance(got, BlocksStored)
    assert got.lora_name == "adapter" and got.has_extra_keys


def test_replay_end_marker_seq_is_minus_one() -> None:
    batch = KVEventBatch(ts=0.0, events=[])
    fr = frames(batch)
    fr[1] = (-1).to_bytes(8, "big", signed=True)
    assert decode_frames(fr).seq == -1


@pytest.mark.parametrize(
    ("fr", "match"),
    [
        ([b"kv", b"\0" * 8], "3 frames"),
        ([b"kv", b"\0" * 4, b""], "8 bytes"),
        ([b"\xff", b"\0" * 8, msgspec.msgpack.encode([0.0, []])], "utf-8"),
        ([b"kv", b"\0" * 8, b"\xc1"], "KVEventBatch"),
        ([b"kv", b"\0" * 8, msgspec.msgpack.encode([0.0, [{"type": "Nope"}]])], "KVEventBatch"),
    ],
)
def test_malformed_frames(fr: list[bytes], match: str) -> None:
    with pytest.raises(KvEventDecodeError, match=match):
        decode_frames(fr)


def test_apply_events_filters_media_and_groups() -> None:
    idx = PrefixIndex()
    events = decode_frames(
        frames(
            KVEventBatch(
                ts=0.0,
                events=[
                    stored([1, 2, 3]),
                    stored([9], medium="CPU"),
                    stored([8], group_idx=1),
                    BlockRemoved(block_hashes=[3], medium="GPU"),
                ],
            )
        )
    ).events
    assert apply_events(idx, 5, events) == 2
    assert idx.find_matches([1, 2, 3]) == {5: 2}
    assert idx.find_matches([9]) == {} and idx.find_matches([8]) == {}
    assert apply_events(idx, 5, [AllCleared()]) == 1
    assert idx.num_blocks(5) == 0


def test_hashes_agree_checks_root_events_only() -> None:
    hasher = BlockHasher(32)
    tokens = list(range(1, 65))
    hashes = hasher.block_hashes(tokens)
    good = BlocksStoredWithTokens(hashes, None, 32, "GPU", 0, token_ids=tokens)
    assert hashes_agree(hasher, good) is True
    assert hashes_agree(BlockHasher(32, seed="0"), good) is False
    assert hashes_agree(BlockHasher(64), good) is False
    child = BlocksStoredWithTokens(hashes[1:], hashes[0], 32, "GPU", 0, token_ids=tokens[32:])
    assert hashes_agree(hasher, child) is None
    salted = BlocksStoredWithTokens(
        hashes, None, 32, "GPU", 0, extra_keys=[("salt",), None], token_ids=tokens
    )
    assert hashes_agree(hasher, salted) is None
