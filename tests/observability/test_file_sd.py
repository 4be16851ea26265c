"""file_sd targets from instance records, atomic writes, the writer over in-memory discovery."""

from __future__ import annotations

import json
from pathlib import Path

from dynagraph.observability.file_sd import (
    FileSdWriter,
    static_target,
    targets_from_records,
    write_atomically,
)
from dynagraph.observability.graph_targets import etcd_targets
from dynagraph.runtime.discovery import MemoryDiscovery, MemoryStore
from dynagraph.sdk._context import process_key
from tests.support.poll import until


def test_targets_from_records() -> None:
    records = {
        "/dynamo/instances/VllmWorker/2b": {"metrics": "127.0.0.1:9002", "worker_index": 1},
        "/dynamo/instances/VllmWorker/1a": {"metrics": "127.0.0.1:9001", "worker_index": 0},
        "/dynamo/instances/Frontend/3c": {"metrics": "127.0.0.1:9000", "worker_index": 0},
        "/dynamo/instances/NoMetrics/4d": {"address": "x"},
        "/dynamo/components/VllmWorker/generate/1a": {"metrics": "127.0.0.1:1"},
    }
    etcd = static_target("127.0.0.1:2379", "etcd")
    groups = targets_from_records(records, [etcd])
    assert groups[0] == etcd
    assert [g["targets"] for g in groups[1:]] == [["127.0.0.1:9000"], ["127.0.0.1:9001"],
                                                 ["127.0.0.1:9002"]]
    assert groups[2]["labels"] == {"job": "dynagraph", "namespace": "dynamo",
                                   "component": "VllmWorker", "instance_id": "1a",
                                   "worker_index": "0"}


def test_instances_sharing_a_process_are_scraped_once() -> None:
    records = {  # an embedded Processor beside its Frontend; two engines of one process
        "/dynamo/instances/Processor/5e": {"metrics": "127.0.0.1:9000", "worker_index": 0},
        "/dynamo/instances/Frontend/3c": {"metrics": "127.0.0.1:9000", "worker_index": 0},
        "/dynamo/instances/MockerWorker/7b": {"metrics": "127.0.0.1:9001", "worker_index": 1},
        "/dynamo/instances/MockerWorker/6a": {"metrics": "127.0.0.1:9001", "worker_index": 0},
    }
    groups = targets_from_records(records)
    assert [(g["targets"], g["labels"]["component"], g["labels"]["instance_id"])
            for g in groups] == [(["127.0.0.1:9000"], "Frontend", "3c"),
                                 (["127.0.0.1:9001"], "MockerWorker", "6a")]


def test_write_atomically_only_when_changed(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "t.json"
    assert write_atomically(str(path), [static_target("a:1", "x")])
    assert not write_atomically(str(path), [static_target("a:1", "x")])
    assert json.loads(path.read_text())[0]["targets"] == ["a:1"]
    assert write_atomically(str(path), [])
    assert json.loads(path.read_text()) == []
    assert [p.name for p in path.parent.iterdir()] == ["t.json"]


def test_etcd_targets() -> None:
    assert etcd_targets("http://127.0.0.1:2379, 127.0.0.1:4001,") == [
        static_target("127.0.0.1:2379", "etcd"), static_target("127.0.0.1:4001", "etcd")]
    assert etcd_targets("") == []


async def test_writer_follows_instances(tmp_path: Path) -> None:
    store = MemoryStore()
    path = tmp_path / "targets.json"

    def addresses() -> list[str]:
        return [g["targets"][0] for g in json.loads(path.read_text())
                if g["labels"]["job"] == "dynagraph"]

    async with MemoryDiscovery(store) as watcher, MemoryDiscovery(store) as first:
        await first.put(process_key("ns", "Worker", first.instance_id),
                        {"metrics": "127.0.0.1:1001", "worker_index": 0}, lease=True)
        writer = FileSdWriter(watcher, ["ns"], str(path), [static_target("127.0.0.1:2379", "etcd")])
        await writer.start()
        assert addresses() == ["127.0.0.1:1001"]
        async with MemoryDiscovery(store) as second:      # scaling up: no config edit
            await second.put(process_key("ns", "Worker", second.instance_id),
                             {"metrics": "127.0.0.1:1002", "worker_index": 1}, lease=True)
            await until(lambda: len(addresses()) == 2)
        await until(lambda: addresses() == ["127.0.0.1:1001"])  # its lease went with it
        first.expire()                                           # a crash
        await until(lambda: addresses() == [])
        await writer.close()
        assert json.loads(path.read_text()) == [static_target("127.0.0.1:2379", "etcd")]
