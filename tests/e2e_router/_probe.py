"""Looks inside a running graph from the test process: etcd records, /metrics, direct calls."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx

from dynagraph.runtime.discovery import EtcdDiscovery
from dynagraph.runtime.rpc import RpcClient
from tests.support.process import pid_alive

NS = "dynamo"


class GraphProbe:
    def __init__(self, etcd_url: str) -> None:
        self.discovery = EtcdDiscovery(etcd_url)
        self.rpc = RpcClient(idle_timeout=30)
        self.http = httpx.AsyncClient(timeout=5)

    async def start(self) -> None:
        await self.discovery.start()

    async def close(self) -> None:
        await self.http.aclose()
        await self.rpc.close()
        await self.discovery.close()

    async def workers(self) -> dict[int, dict[str, Any]]:
        """Live VllmWorker processes: instance id -> process record (pid, metrics, ...).

        A SIGKILLed worker's records stay until its lease expires; its process is gone."""
        recs = await self.discovery.get_prefix(f"/{NS}/instances/VllmWorker/")
        return {int(k.rsplit("/", 1)[1], 16): v for k, v in recs.items()
                if pid_alive(int(v["pid"]))}

    async def processes(self, component: str) -> dict[int, dict[str, Any]]:
        """Live processes of ``component``: instance id -> process record (pid, ...)."""
        recs = await self.discovery.get_prefix(f"/{NS}/instances/{component}/")
        return {int(k.rsplit("/", 1)[1], 16): v for k, v in recs.items()
                if pid_alive(int(v["pid"]))}

    async def wait_workers(self, count: int, within: float = 300) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + within
        while True:
            ws = await self.workers()
            if len(ws) == count:
                return ws
            if time.monotonic() > deadline:
                raise AssertionError(f"expected {count} workers, have {len(ws)}: {ws}")
            await asyncio.sleep(0.2)

    async def prefix_cache(self, record: dict[str, Any]) -> tuple[float, float]:
        """(queries, hits) in prompt tokens, from the worker's /metrics."""
        out = []
        for name in ("dynamo_worker_prefix_cache_queries_total",
                     "dynamo_worker_prefix_cache_hits_total"):
            value = await self.worker_metric(record, name)
            assert value is not None, f"{name} not in /metrics of {record['metrics']}"
            out.append(value)
        return out[0], out[1]

    async def worker_metric(self, record: dict[str, Any], name: str) -> float | None:
        """A worker's (one-engine process's) sample of ``name`` (None: not exported)."""
        text = (await self.http.get(f"http://{record['metrics']}/metrics")).text
        m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        return None if m is None else float(m.group(1))

    async def router_metric(self, name: str) -> dict[str, float]:
        """A per-worker gauge of the Router's /metrics: worker label -> value."""
        recs = await self.discovery.get_prefix(f"/{NS}/instances/Router/")
        assert recs, "no Router process registered"
        text = (await self.http.get(f"http://{next(iter(recs.values()))['metrics']}/metrics")).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            rf'^{name}\{{worker="([0-9a-f]+)"\}} (\S+)$', text, re.M)}

    async def router_address(self) -> str:
        recs = await self.discovery.get_prefix(f"/{NS}/components/Router/generate/")
        assert recs, "no Router registered"
        return str(next(iter(recs.values()))["address"])

    async def route(self, token_ids: list[int]) -> dict[str, Any]:
        """Ask the Router directly (untracked) where ``token_ids`` would go."""
        stream = self.rpc.call(await self.router_address(), "generate", {"token_ids": token_ids})
        try:
            async for item in stream:
                return dict(item)
        finally:
            await stream.aclose()
        raise AssertionError("the Router answered nothing")
