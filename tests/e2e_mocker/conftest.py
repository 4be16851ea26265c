"""Mocker graphs served with ``dynamo serve`` as users run them, on their own etcd and NATS.

One etcd and NATS for this package (the graphs use the ``dynamo`` namespace and the
prefill queue, which no other package's graph may share); each test module serves its
graph once (module scope) and stops it at the end.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from dynagraph.errors import DiscoveryError
from dynagraph.runtime.infra import LocalService
from tests.support.infra import own_infra
from tests.support.metrics import scrape

MODEL = "tiny-llama"
NS = "dynamo"


@pytest.fixture(scope="package")
def mocker_infra() -> Iterator[tuple[LocalService, LocalService]]:
    with own_infra() as (etcd, nats):
        yield etcd, nats


def token_ids(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids of the tiny model's ordinary vocabulary."""
    return [rng.randrange(10, 900) for _ in range(n)]


def complete(url: str, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return dict(r.json())


def per_worker(addresses: list[str], name: str) -> dict[str, float]:
    """``name``'s samples by their ``worker`` label, over the processes at ``addresses``."""
    out: dict[str, float] = {}
    pattern = re.compile(rf'^{re.escape(name)}\{{[^}}]*worker="([0-9a-f]+)"[^}}]*\}} (\S+)$',
                         re.M)
    for address in addresses:
        for m in pattern.finditer(scrape(address)):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


async def records(etcd_url: str, component: str) -> dict[str, dict[str, Any]]:
    """The live instance records of ``component``: hex instance id -> record."""
    from dynagraph.runtime.discovery import EtcdDiscovery

    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    try:
        got = await disc.get_prefix(f"/{NS}/instances/{component}/")
    finally:
        await disc.close()
    return {k.rsplit("/", 1)[1]: v for k, v in got.items()}


def wait_records(etcd_url: str, component: str, count: int, within: float = 30
                 ) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + within
    while True:
        recs = asyncio.run(records(etcd_url, component))
        if len(recs) == count or time.monotonic() > deadline:
            assert len(recs) == count, recs
            return recs
        time.sleep(0.2)


@dataclass
class Load:
    url: str
    clients: int
    max_tokens: int
    prompt_len: int = 96
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    done: list[int] = field(default_factory=list)
    """completion_tokens of every request answered."""
    failed: list[str] = field(default_factory=list)

    async def run(self) -> None:
        rng = random.Random(self.clients)
        async with httpx.AsyncClient(timeout=120) as http:
            async def client() -> None:
                while not self.stop.is_set():
                    prompt = [rng.randrange(10, 900) for _ in range(self.prompt_len)]
                    try:
                        r = await http.post(f"{self.url}/v1/completions", json={
                            "model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens,
                            "temperature": 0})
                    except httpx.HTTPError as exc:
                        self.failed.append(repr(exc))
                        continue
                    if r.status_code != 200:
                        self.failed.append(f"{r.status_code} {r.text[:200]}")
                    else:
                        self.done.append(int(r.json()["usage"]["completion_tokens"]))

            await asyncio.gather(*(client() for _ in range(self.clients)))


async def processes(etcd_url: str, component: str = "MockerWorker") -> int:
    return len({r["pid"] for r in (await records(etcd_url, component)).values()})


async def until_processes(etcd_url: str, pred: str, n: int, within: float,
                          component: str = "MockerWorker") -> list[int]:
    """Poll ``component``'s process count until it is ``pred`` (>= or ==) ``n``."""
    seen: list[int] = []
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            k = await processes(etcd_url, component)
        except DiscoveryError:  # a connection attempt timed out on the loaded machine
            await asyncio.sleep(0.5)
            continue
        if not seen or seen[-1] != k:
            seen.append(k)
        if (k >= n) if pred == ">=" else (k == n):
            return seen
        await asyncio.sleep(0.25)
    raise AssertionError(f"{component} processes never {pred} {n}: {seen}")
