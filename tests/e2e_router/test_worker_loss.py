"""Runs last (file order): kills one worker of the shared graph."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from ._probe import GraphProbe
from .test_kv_routing import BLOCK, complete, served_by, snapshot, tokens, wait_route

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="package")]


async def test_routing_continues_when_a_worker_dies(router_url: str, probe: GraphProbe) -> None:
    workers = await probe.wait_workers(2)
    prefix = tokens(8 * BLOCK)
    before = await snapshot(probe)
    await complete(router_url, prefix + tokens(10))
    victim, _ = await served_by(probe, before)
    assert (await wait_route(probe, prefix, 8))["worker_id"] == victim
    survivor = next(w for w in workers if w != victim)

    os.kill(int(workers[victim]["pid"]), signal.SIGKILL)
    # Requests sharing the dead worker's prefix keep working, at once and after.
    for _ in range(4):
        await complete(router_url, prefix + tokens(10))
    deadline = time.monotonic() + 15
    while True:  # the lease expires within a few seconds: dropped from index and loads
        got = await probe.route(prefix)
        if got["worker_id"] == survivor and got["overlap_blocks"] == 8:
            break  # the survivor served the requests above and now holds the prefix
        assert time.monotonic() < deadline, got
        await asyncio.sleep(0.1)
    for _ in range(3):
        assert (await probe.route(tokens(3 * BLOCK)))["worker_id"] != victim
