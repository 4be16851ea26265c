"""KV-aware routing in a real graph: two vLLM workers, their KV events, the Router."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import pytest

from dynagraph.runtime.discovery import endpoint_prefix

from ._probe import NS, GraphProbe
from .conftest import MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="package")]

BLOCK = 32
rng = random.Random(1234)


def tokens(n: int) -> list[int]:
    return [rng.randrange(10, 900) for _ in range(n)]


async def complete(url: str, prompt: list[int], max_tokens: int = 2) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return dict(r.json())


async def served_by(probe: GraphProbe, before: dict[int, tuple[float, float]],
                    within: float = 10) -> tuple[int, float]:
    """The one worker whose prefix-cache query counter rose since ``before``; its hit rise."""
    deadline = time.monotonic() + within
    while True:
        workers = await probe.workers()
        rose = {}
        for w, rec in workers.items():
            q, h = await probe.prefix_cache(rec)
            if q > before[w][0]:
                rose[w] = h - before[w][1]
        if len(rose) == 1:
            return next(iter(rose.items()))
        assert len(rose) < 2, f"both workers saw the request: {rose}"
        if time.monotonic() > deadline:
            raise AssertionError("no worker's prefix-cache queries rose")
        await asyncio.sleep(0.1)


async def snapshot(probe: GraphProbe) -> dict[int, tuple[float, float]]:
    return {w: await probe.prefix_cache(rec) for w, rec in (await probe.workers()).items()}


async def wait_route(probe: GraphProbe, prompt: list[int], overlap: int,
                     within: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        got = await probe.route(prompt)
        if got["overlap_blocks"] >= overlap or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


async def metric_reaches(probe: GraphProbe, name: str, label: str, at_least: float,
                         within: float = 20.0) -> dict[str, float]:
    """The Router's gauge ``name`` by worker, once ``label``'s reaches ``at_least`` (or
    ``within`` seconds passed)."""
    deadline = time.monotonic() + within
    while True:
        values = await probe.router_metric(name)
        if values.get(label, 0) >= at_least or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.1)


async def test_shared_prefix_follows_the_cache_and_hashes_match_vllm(
        router_url: str, probe: GraphProbe) -> None:
    await probe.wait_workers(2)
    for k in range(4):
        prefix = tokens(8 * BLOCK)
        first = prefix + tokens(20)
        before = await snapshot(probe)
        await complete(router_url, first)
        holder, _ = await served_by(probe, before)
        # The Router's index, built only from vLLM's BlockStored events, holds every full
        # block of the prompt under our own hashes: vLLM's hashes equal ours.
        got = await wait_route(probe, first, len(first) // BLOCK)
        assert got["overlap_blocks"] == len(first) // BLOCK, got
        assert got["worker_id"] == holder

        second = prefix + tokens(40)
        before = await snapshot(probe)
        await complete(router_url, second)
        again, hits = await served_by(probe, before)
        assert again == holder, f"prefix {k}: first on {holder:x}, then on {again:x}"
        assert hits >= 8 * BLOCK, f"prefix-cache hits rose by {hits} only"


async def test_pooled_blocks_reach_the_router_as_their_own_tier(
        router_url: str, probe: GraphProbe) -> None:
    """vLLM's offloading connector publishes the blocks it pools (medium CPU); the
    worker's relay forwards them apart from the engine's, and the Router indexes them."""
    await probe.wait_workers(2)
    before = await snapshot(probe)
    prompt = tokens(6 * BLOCK + 3)
    await complete(router_url, prompt)
    holder, _ = await served_by(probe, before)
    # vLLM stores a request's blocks at the engine's next step: one more request with the
    # same first block (so the Router sends it to the same worker) makes one
    await complete(router_url, prompt[:BLOCK] + tokens(5))
    pooled = await metric_reaches(probe, "dynamo_router_index_pooled_blocks", f"{holder:x}", 6)
    assert pooled.get(f"{holder:x}", 0) >= 6, f"the Router's pooled index: {pooled}"


async def test_the_shared_tier_reaches_the_router_as_a_third_tier(
        router_url: str, probe: GraphProbe) -> None:
    """Both workers name one tier under their pools (``kv_tier`` in their instance
    records, how the Router knows they share it); the blocks a worker writes there reach
    the Router's tier index."""
    workers = await probe.wait_workers(2)
    records = await probe.discovery.get_prefix(endpoint_prefix(NS, "VllmWorker", "kv_events"))
    tiers = {v["metadata"].get("kv_tier") for v in records.values()}
    assert len(records) >= len(workers) and len(tiers) == 1 and None not in tiers, records
    before = await snapshot(probe)
    prompt = tokens(6 * BLOCK + 3)
    await complete(router_url, prompt)
    holder, _ = await served_by(probe, before)
    await complete(router_url, prompt[:BLOCK] + tokens(5))  # a step that stores them
    tiered = await metric_reaches(probe, "dynamo_router_index_tiered_blocks", f"{holder:x}", 6)
    assert tiered.get(f"{holder:x}", 0) >= 6, f"the Router's tier index: {tiered}"
    # the tier's size limit (kv-offload-dir-gib): one worker's trimmer measures it
    deadline = time.monotonic() + 20
    sizes: list[float | None] = []
    while not any(sizes) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        sizes = [await probe.worker_metric(r, "dynamo_worker_kv_tier_bytes")
                 for r in workers.values()]
    assert any(sizes), f"no worker measured the tier: {sizes}"


async def test_concurrent_new_prefixes_spread_over_the_workers(
        router_url: str, probe: GraphProbe) -> None:
    """Two unrelated prompts at once: the first counts as in-flight load on its worker
    (the Router tracks it until it ends), so the second goes to the other worker."""
    workers = await probe.wait_workers(2)
    before = await snapshot(probe)
    prompts = [tokens(16 * BLOCK) for _ in range(2)]
    await asyncio.gather(*(complete(router_url, p, max_tokens=200) for p in prompts))
    deadline = time.monotonic() + 10
    while True:
        after = await snapshot(probe)
        rose = {w for w in workers if after[w][0] > before[w][0]}
        if rose == set(workers) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert rose == set(workers), f"only {rose} served the two prompts"


async def test_mode_switch_through_etcd(router_url: str, probe: GraphProbe) -> None:
    key = "/dynamo/settings/Router/mode"
    prompt = tokens(4 * BLOCK)
    await probe.discovery.put(key, "round-robin")
    try:
        deadline = time.monotonic() + 10
        while (await probe.route(prompt))["mode"] != "round-robin":
            assert time.monotonic() < deadline, "the Router never saw the etcd mode"
            await asyncio.sleep(0.05)
        seen = {(await probe.route(prompt))["worker_id"] for _ in range(4)}
        assert len(seen) == 2
        await complete(router_url, prompt)
    finally:
        await probe.discovery.delete(key)
    deadline = time.monotonic() + 10
    while (await probe.route(prompt))["mode"] != "kv":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
