"""EtcdDiscovery against a real etcd: registration, lease expiry after SIGKILL,
lease loss, etcd restarts and compaction without lost events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aetcd
import pytest

from dynagraph.runtime.discovery import EtcdDiscovery, InstanceInfo, InstanceWatch, instance_key
from dynagraph.runtime.infra import LocalService, find_binary
from tests.support.poll import until

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
TTL = 2


@contextlib.asynccontextmanager
async def discs(url: str, n: int, ttl: int = TTL) -> AsyncIterator[list[EtcdDiscovery]]:
    started: list[EtcdDiscovery] = []
    try:
        for _ in range(n):
            d = EtcdDiscovery(url, lease_ttl=ttl)
            await d.start()
            started.append(d)
        yield started
    finally:
        for d in started:
            await d.close()


def ids(watch: InstanceWatch) -> list[int]:
    return [i.instance_id for i in watch.instances()]


def etcdctl(url: str, *args: str) -> str:
    """Blocking on purpose: while it runs no watch in this event loop can reconnect."""
    out = subprocess.run(
        [find_binary("etcdctl"), f"--endpoints={url}", *args],
        check=True, capture_output=True, timeout=10, env={**os.environ, "ETCDCTL_API": "3"},
    )
    return out.stdout.decode()


async def test_register_and_watch_across_clients(etcd_url: str) -> None:
    async with discs(etcd_url, 3) as (a, b, client):
        info = await a.register("itest1", "Worker", "generate", "127.0.0.1:4000", {"pid": 1})
        raw = await client.get(instance_key("itest1", "Worker", "generate", a.instance_id))
        assert raw == {"address": "127.0.0.1:4000", "instance_id": a.instance_id,
                       "metadata": {"pid": 1}}
        watch = await client.watch_instances("itest1", "Worker", "generate")
        assert watch.instances() == [info]
        seen: list[list[InstanceInfo]] = []
        watch.subscribe(seen.append)
        await b.register("itest1", "Worker", "generate", "127.0.0.1:4001")
        got = await watch.wait_for(2, timeout=5)
        assert [i.instance_id for i in got] == sorted([a.instance_id, b.instance_id])
        assert len(seen) == 1
        await watch.close()


async def test_close_revokes_lease_keys_vanish_at_once(etcd_url: str) -> None:
    async with discs(etcd_url, 1) as (watcher,):
        leaving = EtcdDiscovery(etcd_url, lease_ttl=TTL)
        await leaving.start()
        await leaving.register("itest2", "Worker", "generate", "127.0.0.1:4000")
        await leaving.put("/itest2/nixl/meta", {"agent": "x"}, lease=True)
        await leaving.put("/itest2/settings/kept", 1)
        watch = await watcher.watch_instances("itest2", "Worker", "generate")
        await watch.wait_for(1, timeout=5)
        await leaving.close()
        took = await until(lambda: not watch.instances(), 1.0, "instance removal after close")
        assert await watcher.get_prefix("/itest2/") == {"/itest2/settings/kept": 1}
        log.warning("close(): instance gone from watcher after %.3fs", took)
        await watcher.delete("/itest2/settings/kept")


async def test_sigkilled_process_disappears_within_ttl_plus_1s(etcd_url: str) -> None:
    async with discs(etcd_url, 1) as (watcher,):
        watch = await watcher.watch_instances("itest", "Victim", "generate")
        proc = subprocess.Popen(  # noqa: ASYNC220 - a fork, nothing to wait on
            [sys.executable, "-m", "tests.integration.discovery._registrar", etcd_url, str(TTL)],
            cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
            assert line.startswith(b"ready "), line
            victim = int(line.split()[1], 16)
            await until(lambda: victim in ids(watch), 5, "the victim's registration")
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=5)
            killed_at = time.monotonic()
            await until(lambda: victim not in ids(watch), TTL + 3, "the victim to vanish")
            gone_after = time.monotonic() - killed_at
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
            if proc.stdout is not None:
                proc.stdout.close()
        log.warning("SIGKILL -> gone from watcher after %.3fs (ttl %ds)", gone_after, TTL)
        assert gone_after <= TTL + 1.0


async def test_lost_lease_is_regranted_keeping_instance_id(etcd_url: str) -> None:
    async with discs(etcd_url, 2) as (worker, watcher):
        await worker.register("itest3", "Worker", "generate", "127.0.0.1:4000")
        await worker.put("/itest3/nixl/agent", {"v": 1}, lease=True)
        watch = await watcher.watch_instances("itest3", "Worker", "generate")
        await watch.wait_for(1, timeout=5)
        first_lease = worker.lease_id
        assert first_lease == worker.instance_id
        async with aetcd.Client(*worker.endpoints[0]) as raw:  # as if it had expired
            await raw.revoke_lease(first_lease)
        await until(lambda: not watch.instances(), 2, "removal on revoke")
        took = await until(lambda: len(watch.instances()) == 1, TTL + 2, "re-registration")
        log.warning("lease lost -> re-registered after %.3fs", took)
        assert ids(watch) == [worker.instance_id]
        second_lease = worker.lease_id
        assert second_lease != first_lease
        assert await watcher.get("/itest3/nixl/agent") == {"v": 1}
        # a lease-bound put that is first to notice the loss re-grants by itself
        async with aetcd.Client(*worker.endpoints[0]) as raw:
            await raw.revoke_lease(second_lease)
        await worker.put("/itest3/late", 2, lease=True)
        assert worker.lease_id not in (first_lease, second_lease)
        await until(lambda: len(watch.instances()) == 1, 2, "re-registration after put")
        assert await watcher.get_prefix("/itest3/") == {
            "/itest3/late": 2, "/itest3/nixl/agent": {"v": 1},
            instance_key("itest3", "Worker", "generate", worker.instance_id): {
                "address": "127.0.0.1:4000", "instance_id": worker.instance_id, "metadata": {}},
        }
        # the new lease is the one kept alive: keys survive several TTLs
        await asyncio.sleep(TTL + 1)
        assert ids(watch) == [worker.instance_id]


async def test_a_blocked_event_loop_keeps_the_lease(etcd_url: str) -> None:
    """The keepalive runs on a thread of its own: a loop stuck for 3 TTLs (a busy
    Frontend's, say) loses nothing. Three discoveries of one process (engines of one
    worker process) share that thread, and one request per refresh."""
    async with discs(etcd_url, 3) as workers:
        for i, w in enumerate(workers):
            await w.put(f"/itest6/k{i}", i, lease=True)
        leases = [w.lease_id for w in workers]
        time.sleep(3 * TTL)  # noqa: ASYNC251 - blocking the loop is the point
        assert [await workers[0].get(f"/itest6/k{i}") for i in range(3)] == [0, 1, 2]
        assert [(w.lease_id, w.lease_grants) for w in workers] == [(x, 1) for x in leases]


async def test_start_waits_out_an_etcd_that_does_not_answer_yet(own_etcd: LocalService) -> None:
    """gRPC gives up on one connection attempt after about a second when etcd does not
    answer (256 engines connecting at once did that): start retries until op_timeout."""
    os.kill(own_etcd.proc.pid, signal.SIGSTOP)
    loop = asyncio.get_running_loop()
    resume = loop.call_later(2.0, os.kill, own_etcd.proc.pid, signal.SIGCONT)
    disc = EtcdDiscovery(own_etcd.url, lease_ttl=TTL, op_timeout=8.0)
    try:
        await disc.start()
        assert disc.lease_id is not None
    finally:
        resume.cancel()
        os.kill(own_etcd.proc.pid, signal.SIGCONT)
        await disc.close()


async def test_etcd_restart_loses_no_registration_or_event(own_etcd: LocalService) -> None:
    url = own_etcd.url
    async with discs(url, 3) as (a, b, watcher):
        await a.register("itest4", "Worker", "generate", "127.0.0.1:4000")
        await b.register("itest4", "Worker", "generate", "127.0.0.1:4001")
        await watcher.put("/itest4/settings/router", {"mode": "kv"})
        watch = await watcher.watch_instances("itest4", "Worker", "generate")
        await watch.wait_for(2, timeout=5)
        history: list[list[int]] = []
        watch.subscribe(lambda insts: history.append([i.instance_id for i in insts]))
        settings = watcher.watch_prefix("/itest4/settings/")
        assert await anext(settings) == ("/itest4/settings/router", {"mode": "kv"})

        # Restart and write while this loop is blocked, so the watches are certainly
        # disconnected when these changes happen: they must be replayed, not lost.
        own_etcd.restart()
        ghost = instance_key("itest4", "Worker", "generate", 0xABC)
        etcdctl(url, "put", ghost, '{"address":"127.0.0.1:9","instance_id":2748,"metadata":{}}')
        etcdctl(url, "del", ghost)
        etcdctl(url, "put", "/itest4/settings/router", '{"mode":"round-robin"}')
        restarted = time.monotonic()

        assert await asyncio.wait_for(anext(settings), 10) == (
            "/itest4/settings/router", {"mode": "round-robin"})
        await until(lambda: len(history) >= 2, 10, "the ghost's put and delete")
        recovered = time.monotonic() - restarted
        both = sorted([a.instance_id, b.instance_id])
        assert history[:2] == [sorted([*both, 0xABC]), both]
        log.warning("etcd restart: watches caught up %.3fs after etcd was back", recovered)

        # Leases survived (or were re-granted): registrations outlive a few TTLs,
        # and new changes after the restart are seen.
        await asyncio.sleep(TTL + 0.5)
        assert ids(watch) == both
        await b.close()
        await until(lambda: ids(watch) == [a.instance_id], 2, "b's removal after restart")
        await watcher.put("/itest4/settings/router", {"mode": "random"})
        assert await asyncio.wait_for(anext(settings), 5) == (
            "/itest4/settings/router", {"mode": "random"})
        await settings.aclose()


async def test_compacted_revision_falls_back_to_resync(own_etcd: LocalService) -> None:
    url = own_etcd.url
    async with discs(url, 2) as (a, watcher):
        await a.register("itest5", "Worker", "generate", "127.0.0.1:4000")
        watch = await watcher.watch_instances("itest5", "Worker", "generate")
        await watch.wait_for(1, timeout=5)
        own_etcd.restart()
        added = instance_key("itest5", "Worker", "generate", 0xDEF)
        etcdctl(url, "put", added, '{"address":"127.0.0.1:9","instance_id":3567,"metadata":{}}')
        out = etcdctl(url, "put", "/itest5/filler", "1", "-w", "json")
        rev = _revision(out)
        etcdctl(url, "compact", str(rev))
        await until(lambda: len(watch.instances()) == 2, 10, "the change made before compaction")
        assert ids(watch) == sorted([a.instance_id, 0xDEF])
        mirrors = list(watcher._mirrors)
        assert sum(m.resyncs for m in mirrors) >= 1
        # and it keeps following afterwards
        await a.close()
        await until(lambda: ids(watch) == [0xDEF], 2, "a's removal after the resync")


def _revision(etcdctl_json: str) -> int:
    import json

    data: dict[str, Any] = json.loads(etcdctl_json)
    return int(data["header"]["revision"])
