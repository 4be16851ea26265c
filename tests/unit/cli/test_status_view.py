"""``dynamo status`` rendering: exact tables from snapshots, load from worker metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dynagraph.cli.live_catalog import SettingValue
from dynagraph.cli.status_view import Instance, Load, Snapshot, age, load_from_metrics, render
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.engines.metrics import register_engine_load

NOW = 1_000_000.0


def snapshot() -> Snapshot:
    def inst(component: str, iid: str, **kw: object) -> Instance:
        base: dict[str, object] = {"namespace": "dynamo", "component": component,
                                   "instance_id": iid, "state": "ready", "host": "box",
                                   "started_at": NOW - 302, "health": "ok"}
        return Instance(**{**base, **kw})  # type: ignore[arg-type]  # test data by keyword

    return Snapshot(
        found="dynamo serve pid 7: graphs.agg_router:Frontend, namespace dynamo, etcd "
              "http://127.0.0.1:2379 (started by it)",
        etcd="http://127.0.0.1:2379", namespaces=["dynamo"], taken_at=NOW, local_host="box",
        expected={"Frontend": 1, "Router": 1, "VllmWorker": 2},
        instances=[
            inst("VllmWorker", "b2", worker_index=1, state="starting", pid=13,
                 started_at=NOW - 45, health="-"),
            inst("Frontend", "f1", worker_index=0, address="127.0.0.1:4001", pid=11,
                 url="http://127.0.0.1:8000"),
            inst("VllmWorker", "a1", worker_index=0, address="127.0.0.1:4003", pid=12,
                 load=Load(running=2, waiting=0, kv_usage=0.03125, kv_used_blocks=512,
                           kv_total_blocks=16384)),
            inst("VllmWorker", "c3", worker_index=2, address="10.0.0.9:4005", pid=99,
                 host="other", health="no metrics", started_at=NOW - 7300),
        ],
        settings=[
            SettingValue("Router", "dynamo", "mode", "round-robin", "etcd", "round-robin",
                         "one of kv, kv-load, round-robin, random"),
            SettingValue("Router", "dynamo", "overlap-weight", 1.0, "config", None,
                         "a number >= 0"),
            SettingValue("Router", "dynamo", "temperature", 0.0, "etcd, ignored", -3,
                         "a number >= 0"),
        ])


def test_render_is_one_row_per_instance_grouped_by_component() -> None:
    assert render(snapshot()).splitlines() == [
        "dynamo status: dynamo serve pid 7: graphs.agg_router:Frontend, namespace dynamo, "
        "etcd http://127.0.0.1:2379 (started by it)",
        "",
        "COMPONENT   READY              INSTANCE  ADDRESS         PID    UPTIME  HEALTH        "
        "RUNNING  WAITING  KV USED",
        "Frontend    1/1                f1        127.0.0.1:4001  11     5m02s   ok",
        "Router      0/1                -         -               -      -       none running",
        "VllmWorker  2/2 (+1 starting)  a1        127.0.0.1:4003  12     5m02s   ok            "
        "2        0        3.1% (512/16384)",
        "                               c3        10.0.0.9:4005   other  2h01m   no metrics",
        "                               b2        -               13     45s     starting",
        "",
        "live settings (dynamo settings get|set|unset COMPONENT KEY [VALUE]):",
        "  Router  mode            round-robin  etcd",
        "  Router  overlap-weight  1            config",
        "  Router  temperature     0            config (etcd holds -3, not a number >= 0: "
        "ignored)",
    ]


def test_json_counts_components_including_the_missing_and_the_starting() -> None:
    data = snapshot().to_json()
    assert data["components"] == {
        "Frontend": {"ready": 1, "starting": 0, "expected": 1},
        "Router": {"ready": 0, "starting": 0, "expected": 1},
        "VllmWorker": {"ready": 2, "starting": 1, "expected": 2},
    }
    assert data["instances"][2]["load"] == {"running": 2, "waiting": 0, "kv_usage": 0.03125,
                                            "kv_used_blocks": 512, "kv_total_blocks": 16384}
    assert data["settings"][0]["source"] == "etcd"


def test_an_empty_namespace_says_so() -> None:
    snap = Snapshot(found="etcd http://e:1 (given), every namespace", etcd="http://e:1",
                    namespaces=[], taken_at=NOW, local_host="box")
    assert render(snap).splitlines() == [
        "dynamo status: etcd http://e:1 (given), every namespace", "",
        "no components registered in etcd"]


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (59.9, "59s"), (60, "1m00s"), (302, "5m02s"), (3600, "1h00m"),
    (7300, "2h01m"), (90061, "1d01h"), (-5, "0s"),
])
def test_age(seconds: float, text: str) -> None:
    assert age(seconds) == text


def test_load_comes_from_the_workers_own_metrics_text() -> None:
    reg = CollectorRegistry()
    register_engine_load(lambda: EngineLoad(running=3, waiting=1, kv_blocks_used=10,
                                            kv_blocks_total=40), worker="a1", registry=reg)
    register_engine_load(lambda: EngineLoad(running=9), worker="zz", registry=reg)
    text = generate_latest(reg).decode()
    assert load_from_metrics(text, "a1") == Load(running=3, waiting=1, kv_usage=0.25,
                                                 kv_used_blocks=10, kv_total_blocks=40)
    assert load_from_metrics("# nothing here\n", "a1") is None
