"""Stand-ins (``@service(stands_in_for=...)``) and several instances per process
(``@service(instances_key=...)``, ``ProcessInstances``), with in-memory discovery."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pydantic import Field

from dynagraph.cli._banner import component_lines
from dynagraph.config import ConfigModel
from dynagraph.errors import ConfigError, GraphError
from dynagraph.runtime.discovery import MemoryDiscovery, MemoryStore
from dynagraph.sdk import Graph, endpoint, resolve_config, service
from dynagraph.sdk._config import instances_per_process
from dynagraph.sdk._process import ProcessInstances
from tests.unit.sdk.example_components import Back, Front, Middle, Numbers


class FakeBackConfig(ConfigModel):
    copies: int = Field(default=1, ge=1)


@service(dynamo={"namespace": "test"}, stands_in_for=Back, instances_key="copies")
class FakeBack:
    """Back's endpoints, several per process."""

    def __init__(self, config: FakeBackConfig) -> None:
        self.config = config

    @endpoint()
    async def generate(self, request: Numbers) -> AsyncIterator[int]:
        for i in range(request.n):
            yield -i


@service(dynamo={"namespace": "test"}, stands_in_for=Back)
class OtherBack:
    @endpoint()
    async def generate(self, request: Numbers) -> AsyncIterator[int]:
        yield 0


@service(dynamo={"namespace": "test"}, stands_in_for=Back)
class PartialBack:
    @endpoint()
    async def other(self, request: Numbers) -> AsyncIterator[int]:
        yield 0


class Words(Numbers):
    """Another request type."""


@service(dynamo={"namespace": "test"}, stands_in_for=Back)
class MistypedBack:
    @endpoint()
    async def generate(self, request: Words) -> AsyncIterator[int]:
        yield 0


def test_a_stand_in_takes_the_edges_to_the_class_it_replaces() -> None:
    g = Front.link(Middle).link(FakeBack)
    g.validate()
    assert g.edges(Middle) == {"back": FakeBack, "extra": None}
    # the class itself wins when both are linked
    assert Front.link(Middle).link(Back).link(FakeBack).edges(Middle)["back"] is Back


def test_stand_ins_must_be_unambiguous_and_complete() -> None:
    with pytest.raises(GraphError, match="all stand in for Back"):
        Front.link(Middle).link(FakeBack).link(OtherBack).validate()
    with pytest.raises(GraphError, match="PartialBack stands in for Back but lacks its "
                                         "endpoint\\(s\\) generate"):
        Front.link(Middle).link(PartialBack).validate()
    with pytest.raises(GraphError, match="MistypedBack.generate takes Words and yields plain "
                                         "values; Back's, which it stands in for, Numbers"):
        Front.link(Middle).link(MistypedBack).validate()


def test_instances_key_must_name_a_config_key() -> None:
    with pytest.raises(GraphError, match="instances_key 'nope' is not a key"):
        @service(instances_key="nope")
        class Broken:
            def __init__(self, config: FakeBackConfig) -> None: ...


def test_instances_per_process_comes_from_the_named_key(tmp_path: Path) -> None:
    g = Front.link(Middle).link(FakeBack)
    path = tmp_path / "g.yaml"
    path.write_text("FakeBack:\n  copies: 8\n  ServiceArgs:\n    workers: 3\n")
    cfg = resolve_config(g, path)
    assert (cfg["FakeBack"].instances_per_process, cfg["FakeBack"].instances) == (8, 24)
    assert (cfg["Middle"].instances_per_process, cfg["Middle"].instances) == (1, 1)
    assert instances_per_process(FakeBack, {"copies": 2}) == 2
    assert instances_per_process(Middle, {"copies": 2}) == 1
    with pytest.raises(ConfigError, match="whole number"):
        instances_per_process(FakeBack, {"copies": True})


async def test_process_instances_register_each_on_its_own_lease() -> None:
    store = MemoryStore()
    g = Graph.of(FakeBack)
    made: list[MemoryDiscovery] = []

    def new_discovery() -> MemoryDiscovery:
        made.append(MemoryDiscovery(store))
        return made[-1]

    watcher = MemoryDiscovery(store)
    await watcher.start()
    watch = await watcher.watch_instances("test", "FakeBack", "generate")
    proc = ProcessInstances(g, FakeBack, {"copies": 3}, count=3, new_discovery=new_discovery,
                            worker_index=2)
    await proc.start()
    try:
        ids = {i.instance_id for i in watch.instances()}
        assert ids == {d.instance_id for d in made} and len(ids) == 3
        records = await watcher.get_prefix("/test/instances/FakeBack/")
        assert sorted(r["worker_index"] for r in records.values()) == [6, 7, 8]
        assert len(proc.instances) == 3
    finally:
        await proc.stop()
    assert watch.instances() == []
    assert await watcher.get_prefix("/test/instances/FakeBack/") == {}
    await watcher.close()


async def test_a_failing_instance_stops_the_others() -> None:
    store = MemoryStore()
    calls = 0

    def new_discovery() -> MemoryDiscovery:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("no discovery for the third")
        return MemoryDiscovery(store)

    proc = ProcessInstances(Graph.of(FakeBack), FakeBack, {}, count=4,
                            new_discovery=new_discovery)
    with pytest.raises(RuntimeError, match="third"):
        await proc.start()
    assert proc.runtimes == []
    probe = MemoryDiscovery(store)
    await probe.start()
    assert await probe.get_prefix("/test/") == {}
    await probe.close()


def test_the_banner_lists_few_instances_and_summarises_many() -> None:
    few = [{"worker_index": i, "pid": 10, "address": f"a:{i}", "metrics": "m:1"}
           for i in (1, 0)]
    assert component_lines("W", few) == ["  W[0] pid=10 rpc=a:0 metrics=m:1",
                                         "  W[1] pid=10 rpc=a:1 metrics=m:1"]
    many = [{"worker_index": i, "pid": 100 + i // 64, "address": f"a:{i}",
             "metrics": f"m:{i // 64}"} for i in range(256)]
    lines = component_lines("MockerWorker", many)
    assert lines[0] == "  MockerWorker: 256 instances in 4 processes"
    assert lines[1:] == [f"    pid={100 + p} instances=64 worker_index={64 * p}-{64 * p + 63} "
                         f"metrics=m:{p}" for p in range(4)]
