"""The session engine publishes vLLM KV cache events on its ipc:// endpoint."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from dynagraph.llm.engines import SamplingSpec
from dynagraph.llm.engines.vllm.engine import VllmEngine
from tests.vllm.conftest import TEST_BLOCK_SIZE

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]


async def _events(sock: zmq.asyncio.Socket, within_s: float) -> list[dict[str, Any]]:
    """Events received until ``within_s`` passes with nothing new."""
    events: list[dict[str, Any]] = []
    while True:
        try:
            topic, seq, payload = await asyncio.wait_for(sock.recv_multipart(), within_s)
        except TimeoutError:
            return events
        assert topic == b"test-engine" and len(seq) == 8
        _ts, batch, *_ = msgpack.unpackb(payload, raw=False)
        events.extend(batch)


async def test_full_blocks_of_a_prompt_are_reported(
    vllm_engine: VllmEngine, kv_events_endpoint: str
) -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(kv_events_endpoint)
    try:
        spec = SamplingSpec(temperature=0.0, max_tokens=1)
        # The subscription reaches the publisher asynchronously: poll with fresh prompts.
        deadline = time.monotonic() + 30
        salt = 0
        while True:
            salt += 1
            prompt = [0] + [
                7 + (salt * 131 + i * 17) % 1900 for i in range(3 * TEST_BLOCK_SIZE + 4)
            ]
            async for _ in vllm_engine.generate(f"kv-{salt}", prompt, spec):
                pass
            events = await _events(sub, within_s=1.0)
            stored = [e for e in events if e["type"] == "BlockStored"]
            tokens = [t for e in stored for t in e["token_ids"]]
            if tokens[: 3 * TEST_BLOCK_SIZE] == prompt[: 3 * TEST_BLOCK_SIZE]:
                break
            assert time.monotonic() < deadline, f"no matching BlockStored events: {events}"
        assert all(e["block_size"] == TEST_BLOCK_SIZE for e in stored)
        hashes = [h for e in stored for h in e["block_hashes"]]
        assert len(hashes) == 3 and len(set(hashes)) == 3  # the partial 4th block is not stored
        assert stored[0]["parent_block_hash"] is None
    finally:
        sub.close(linger=0)
        ctx.term()
