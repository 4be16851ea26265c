"""Our block hashes against the ones a real vLLM engine publishes in BlockStored events."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
import zmq.asyncio

from dynagraph.llm.router.events import (
    AllCleared,
    BlocksStored,
    BlocksStoredWithTokens,
    KvEvent,
    apply_events,
    decode_frames,
    hashes_agree,
)
from dynagraph.llm.router.hashing import BlockHasher, seed_from_env
from dynagraph.llm.router.index import PrefixIndex

from .conftest import BLOCK_SIZE, VOCAB

pytestmark = pytest.mark.vllm

WORKER = 0x1234_5678_9ABC


async def _generate(llm: Any, token_ids: list[int]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    async for _ in llm.generate(TokensPrompt(prompt_token_ids=token_ids), params, uuid.uuid4().hex):
        pass


async def _collect(sock: zmq.asyncio.Socket, until: Any, within: float = 30.0) -> list[KvEvent]:
    """Receive event batches until ``until(events)`` holds; fail after ``within`` s."""
    events: list[KvEvent] = []
    deadline = time.monotonic() + within
    while not until(events):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"KV events did not arrive within {within}s; got {events}")
        frames = await asyncio.wait_for(sock.recv_multipart(), timeout=left)
        batch = decode_frames(frames, with_tokens=True)
        assert batch.topic == "kv"
        events.extend(batch.events)
    return events


def _stored_hashes(events: Sequence[KvEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlocksStored) for h in e.block_hashes]


async def test_block_stored_hashes_match_ours(
    vllm_engine: Any, kv_sub: tuple[zmq.asyncio.Socket, str]
) -> None:
    sock, _ = kv_sub
    hasher = BlockHasher(BLOCK_SIZE, "sha256", seed_from_env(os.environ))
    rng = random.Random(3)
    prompt = [rng.randrange(3, VOCAB) for _ in range(4 * BLOCK_SIZE + 7)]
    ours = hasher.block_hashes(prompt)

    # The publisher's PUB connects asynchronously: retry a fresh prompt until one arrives.
    deadline = time.monotonic() + 60
    while True:
        await _generate(vllm_engine, [rng.randrange(3, VOCAB) for _ in range(BLOCK_SIZE + 1)])
        try:
            await _collect(sock, lambda ev: bool(_stored_hashes(ev)), within=2.0)
            break
        except (AssertionError, TimeoutError):
            if time.monotonic() > deadline:
                raise
    await _generate(vllm_engine, prompt)
    events = await _collect(sock, lambda ev: set(ours) <= set(_stored_hashes(ev)))

    stored = [e for e in events if isinstance(e, BlocksStored) and set(e.block_hashes) & set(ours)]
    assert _stored_hashes(stored) == ours
    first = stored[0]
    assert first.parent_hash is None and first.block_size == BLOCK_SIZE
    assert isinstance(first, BlocksStoredWithTokens) and hashes_agree(hasher, first)
    # An event's token ids chained from its parent give its hashes too.
    for ev in stored:
        assert isinstance(ev, BlocksStoredWithTokens)
        assert len(ev.token_ids) == BLOCK_SIZE * len(ev.block_hashes)
        start = ours.index(ev.block_hashes[0])
        assert ev.parent_hash == (ours[start - 1] if start else None)
        assert (
            ev.token_ids == prompt[start * BLOCK_SIZE : (start + len(ev.block_hashes)) * BLOCK_SIZE]
        )

    index = PrefixIndex()
    apply_events(index, WORKER, events)
    assert index.find_matches(ours) == {WORKER: 4}

    # A second prompt sharing two blocks: its new blocks chain from the shared ones.
    second = prompt[: 2 * BLOCK_SIZE] + [rng.randrange(3, VOCAB) for _ in range(2 * BLOCK_SIZE)]
    ours2 = hasher.block_hashes(second)
    assert ours2[:2] == ours[:2] and ours2[2:] != ours[2:4]
    assert index.find_matches(ours2) == {WORKER: 2}
    await _generate(vllm_engine, second)
    events2 = await _collect(sock, lambda ev: set(ours2[2:]) <= set(_stored_hashes(ev)))
    new = [e for e in events2 if isinstance(e, BlocksStored) and ours2[2] in e.block_hashes]
    assert new[0].parent_hash == ours2[1]
    apply_events(index, WORKER, events2)
    assert index.find_matches(ours2) == {WORKER: 4}

    # reset_prefix_cache queues AllBlocksCleared; the next scheduler step publishes it.
    assert await vllm_engine.reset_prefix_cache()
    third = [rng.randrange(3, VOCAB) for _ in range(BLOCK_SIZE + 1)]
    ours3 = hasher.block_hashes(third)
    await _generate(vllm_engine, third)
    events3 = await _collect(
        sock,
        lambda ev: any(isinstance(e, AllCleared) for e in ev) and ours3[0] in _stored_hashes(ev),
    )
    apply_events(index, WORKER, events3)
    assert index.find_matches(ours) == {}
    assert index.find_matches(ours3) == {WORKER: 1}
    assert index.num_blocks(WORKER) == 1
