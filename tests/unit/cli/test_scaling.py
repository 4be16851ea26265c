"""Which workers ``dynamo serve`` starts or retires for a replica count; scale keys."""

from __future__ import annotations

from typing import Any

import pytest

from dynagraph.cli.scaling import reconcile
from dynagraph.planner.connector import (
    EtcdScaleConnector,
    count_processes,
    parse_replicas,
    scale_key,
)
from dynagraph.runtime.discovery import MemoryDiscovery, MemoryStore


def test_nothing_to_do() -> None:
    assert reconcile([0, 1], [], 2) == ([], [])


def test_start_takes_the_lowest_free_indexes() -> None:
    assert reconcile([0, 2], [], 4) == ([1, 3], [])


def test_a_draining_worker_keeps_its_index() -> None:
    assert reconcile([0], [1], 3) == ([2, 3], [])


def test_retire_the_highest_first() -> None:
    assert reconcile([0, 3, 1, 2], [], 1) == ([], [3, 2, 1])
    assert reconcile([0, 1], [], 0) == ([], [1, 0])


def test_negative_is_refused() -> None:
    with pytest.raises(ValueError):
        reconcile([], [], -1)


@pytest.mark.parametrize(("value", "expected"), [
    (3, 3), ({"replicas": 0}, 0), ({"replicas": 2}, 2), (None, None), (-1, None),
    (True, None), ("2", None), ({"n": 2}, None), (2.0, None),
])
def test_parse_replicas(value: Any, expected: int | None) -> None:
    assert parse_replicas(value) == expected


def test_processes_are_counted_once_per_host_and_pid() -> None:
    records = {"/d/instances/W/1": {"pid": 10, "host": "a"},
               "/d/instances/W/2": {"pid": 10, "host": "a"},  # a second engine, same process
               "/d/instances/W/3": {"pid": 11, "host": "a"},
               "/d/instances/W/4": {"pid": 10, "host": "b"}}
    assert count_processes(records) == 3


async def test_etcd_connector_writes_the_scale_key_on_its_lease() -> None:
    store = MemoryStore()
    disc, reader = MemoryDiscovery(store), MemoryDiscovery(store)
    await disc.start()
    await reader.start()
    try:
        conn = EtcdScaleConnector(disc, "dyn")
        await conn.set_replicas("MockerWorker", 3)
        assert scale_key("dyn", "MockerWorker") == "/dyn/scale/MockerWorker"
        assert await reader.get_prefix("/dyn/scale/") == {
            "/dyn/scale/MockerWorker": {"replicas": 3}}
        await reader.put("/dyn/instances/MockerWorker/a", {"pid": 1, "host": "h"}, lease=True)
        await reader.put("/dyn/instances/MockerWorkerX/b", {"pid": 2, "host": "h"}, lease=True)
        assert await conn.serving("MockerWorker") == 1
        with pytest.raises(ValueError):
            await conn.set_replicas("MockerWorker", -1)
        disc.expire()  # the connector's process is gone: so is its scale key (its lease)
        assert await reader.get_prefix("/dyn/scale/") == {}
    finally:
        await disc.close()
        await reader.close()
