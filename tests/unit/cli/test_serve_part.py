"""``dynamo serve --service-name``: which components start here, which instances are ours,
and what is refused before anything starts (exit code 2)."""

from __future__ import annotations

import pytest

from dynagraph.cli import serve_part
from dynagraph.cli.main import main
from dynagraph.errors import ConfigError, GraphError
from dynagraph.sdk._config import resolve_config
from dynagraph.sdk._graph import resolve_target

TARGET = "tests.integration.sdk.demo_graph:Entry"


def test_select_starts_the_named_components_with_their_configs() -> None:
    graph = resolve_target(TARGET)
    configs = resolve_config(graph, None, ["--Source.step=3"])
    here = serve_part.select(graph, configs, ["Source"])
    assert list(here) == ["Source"] and here["Source"].values == {"step": 3}
    assert list(serve_part.select(graph, configs, [])) == list(graph.names())
    assert serve_part.is_partial(graph, ["Source"])
    assert not serve_part.is_partial(graph, [])
    assert not serve_part.is_partial(graph, list(graph.names()))
    with pytest.raises(GraphError, match=r"Sorce: not in the graph \(its components: Entry"):
        serve_part.select(graph, configs, ["Sorce"])


def test_own_keeps_only_this_serves_instances() -> None:
    records: dict[str, list[dict[str, object]]] = {"Source": [{"pid": 1, "serve_id": "a"}, {"pid": 2, "serve_id": "b"},
                          {"pid": 3}],
               "Relay": [{"pid": 4, "serve_id": "b"}]}
    assert serve_part.own(records, "a") == {"Source": [{"pid": 1, "serve_id": "a"}]}
    assert serve_part.own(records, "c") == {}


def test_shared_infra() -> None:
    assert serve_part.missing_shared_infra({}) == ["ETCD_ENDPOINTS", "NATS_SERVER"]
    assert serve_part.missing_shared_infra({"ETCD_ENDPOINTS": "http://e:2379",
                                            "NATS_SERVER": "nats://n:4222"}) == []


def test_a_loopback_host_key_is_refused_when_this_host_is_not_loopback() -> None:
    graph = resolve_target("graphs.agg:Frontend")
    configs = resolve_config(graph, "configs/agg.yaml", [])
    serve_part.check_hosts(configs, "127.0.0.1")
    with pytest.raises(ConfigError) as info:
        serve_part.check_hosts(configs, "198.18.0.1")
    assert info.value.component == "Frontend" and info.value.key == "host"
    assert "--Frontend.host=198.18.0.1" in str(info.value)
    ok = resolve_config(graph, "configs/agg.yaml", ["--Frontend.host=0.0.0.0"])
    serve_part.check_hosts(ok, "198.18.0.1")


@pytest.fixture
def no_infra(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ETCD_ENDPOINTS", "NATS_SERVER", "DYNAMO_HOST"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.usefixtures("no_infra")
def test_part_of_a_graph_without_shared_etcd_and_nats_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", TARGET, "--service-name", "Source"]) == 2
    err = capsys.readouterr().err
    assert "must share one etcd and one NATS" in err and "ETCD_ENDPOINTS, NATS_SERVER" in err


@pytest.mark.usefixtures("no_infra")
@pytest.mark.parametrize(("args", "says"), [
    (["--service-name", "Nope"], "Nope: not in the graph"),
    (["--host", "0.0.0.0"], "not 0.0.0.0"),
    (["--host", "198.51.100.77"], "not an address of this host"),
])
def test_bad_service_names_and_hosts_stop_before_anything_starts(
        args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", TARGET, *args]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.usefixtures("no_infra")
def test_dry_run_names_what_runs_here(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", TARGET, "--dry-run", "--host", "198.18.0.9",
                 "--service-name", "Relay", "--service-name", "Source"]) == 0
    assert "on this host (198.18.0.9): Relay, Source" in capsys.readouterr().out


def test_an_embedded_component_starts_with_its_host() -> None:
    graph = resolve_target("graphs.agg:Frontend")
    configs = resolve_config(graph, "configs/agg.yaml",
                             ["--Processor.ServiceArgs.embed-in=Frontend"])
    assert list(serve_part.select(graph, configs, ["Frontend"])) == ["Frontend", "Processor"]
    assert list(serve_part.select(graph, configs, ["VllmWorker"])) == ["VllmWorker"]
    with pytest.raises(GraphError, match="Processor: it runs inside Frontend's processes"):
        serve_part.select(graph, configs, ["Processor"])
