"""PrefixMirror's recovery logic against a scripted fake aetcd client (no etcd)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aetcd.exceptions
import aetcd.rpc as rpc
import aetcd.rtypes as rtypes
import pytest

from dynagraph.runtime.discovery import _etcd_mirror
from dynagraph.runtime.discovery._etcd_mirror import PrefixMirror

PUT, DELETE = 0, 1


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_etcd_mirror, "BACKOFF_START", 0.001)


def ev(kind: int, key: str, rev: int, value: str = "") -> rtypes.Event:
    return rtypes.Event(kind, rpc.KeyValue(key=key.encode(), value=value.encode(), mod_revision=rev))


class FakeWatch:
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __aiter__(self) -> AsyncIterator[rtypes.Event]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[rtypes.Event]:
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            yield item
        await asyncio.Event().wait()  # a live watch with nothing more to say

    async def cancel(self) -> None:
        return None


class FakeClient:
    """``snapshots``: successive get_prefix results; ``watches``: successive watch scripts
    (a list of events/exceptions, or an exception raised at creation)."""

    def __init__(self, snapshots: list[tuple[int, dict[str, str]]], watches: list[Any]) -> None:
        self.snapshots = snapshots
        self.watches = watches
        self.watch_starts: list[int] = []

    async def get_prefix(self, prefix: bytes) -> rtypes.GetRange:
        rev, data = self.snapshots.pop(0)
        kvs = [rpc.KeyValue(key=k.encode(), value=v.encode()) for k, v in data.items()]
        return rtypes.GetRange(rpc.ResponseHeader(revision=rev), kvs, False, len(kvs))

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> FakeWatch:
        self.watch_starts.append(start_revision)
        script = self.watches.pop(0) if self.watches else []
        if isinstance(script, BaseException):
            raise script
        return FakeWatch(script)


async def run_mirror(client: FakeClient, until_starts: int) -> list[tuple[str, Any]]:
    seen: list[tuple[str, Any]] = []
    mirror = PrefixMirror(client, "/p/", lambda k, v: seen.append((k, v)), timeout=1)  # type: ignore[arg-type]
    await mirror.start()
    for _ in range(500):
        if len(client.watch_starts) >= until_starts:
            break
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    await mirror.close()
    return seen


async def test_rewatch_from_last_revision_plus_one_after_error() -> None:
    lost = aetcd.exceptions.ConnectionFailedError("etcd restarting")
    client = FakeClient(
        snapshots=[(10, {"/p/a": "1"})],
        watches=[
            [ev(PUT, "/p/b", 11, "2"), ev(DELETE, "/p/a", 12), ev(DELETE, "/p/b", 12), lost],
            lost,  # still down at the first retry
            [ev(PUT, "/p/c", 13, "3")],
        ],
    )
    seen = await run_mirror(client, until_starts=3)
    assert client.watch_starts == [11, 13, 13]
    assert seen == [("/p/a", 1), ("/p/b", 2), ("/p/a", None), ("/p/b", None), ("/p/c", 3)]


async def test_compacted_revision_resyncs_by_diff() -> None:
    client = FakeClient(
        snapshots=[(5, {"/p/a": "1", "/p/b": "2"}), (20, {"/p/b": "2", "/p/c": "4", "/p/d": "[]"})],
        watches=[
            [aetcd.exceptions.ConnectionFailedError("down")],
            aetcd.exceptions.RevisionCompactedError(15),
            [ev(PUT, "/p/d", 21, "5")],
        ],
    )
    seen = await run_mirror(client, until_starts=3)
    assert client.watch_starts == [6, 6, 21]
    # only the differences: a deleted, c and d new; b unchanged is not re-announced
    assert seen[:2] == [("/p/a", 1), ("/p/b", 2)]
    assert sorted(seen[2:5], key=str) == sorted([("/p/a", None), ("/p/c", 4), ("/p/d", [])], key=str)
    assert seen[5:] == [("/p/d", 5)]


async def test_non_json_values_are_skipped() -> None:
    client = FakeClient(snapshots=[(1, {"/p/a": "not json", "/p/b": "true"})], watches=[[]])
    assert await run_mirror(client, until_starts=1) == [("/p/b", True)]
