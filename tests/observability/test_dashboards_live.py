"""Every dashboard panel returns data from a real Prometheus that scraped a running graph.

For each graph (agg; disagg_router, which has every component of agg_router and disagg
too: one graph serves the routing and disaggregation panels), the test starts the graph with ``dynamo serve`` (its
file_sd targets file in a temp dir), starts Debian's Prometheus through
``scripts/prometheus.sh`` against that file, drives traffic, and then for every
panel assigned to the graph in ``deploy/grafana/requirements.yaml``: every metric
the panel reads has series, and every expression returns data. It also runs
``promtool check metrics`` on every scraped endpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.observability import dashboards as dash
from dynagraph.observability.catalog import PENDING_RENAMES
from dynagraph.runtime.infra import LocalService
from tests.support.serve import REPO

from .conftest import DASHBOARDS, promtool_check_metrics, requirements
from .live import (
    PrometheusScript,
    ServeProcess,
    active_targets,
    drive_traffic,
    metrics_text,
    query,
    serve_args,
    wait_until,
)

MARKS = {"agg": [pytest.mark.integration, pytest.mark.vllm],
         "disagg_router": [pytest.mark.integration, pytest.mark.vllm, pytest.mark.nixl]}
LONG_PROMPTS = {"disagg_router": 4}
"""Prompts over the disagg_router config's max-local-prefill-length (512): remote
prefills, so the queue and KV-transfer panels have data."""
MOVED = {
    "agg": ["dynamo_frontend_requests_total"],
    "disagg_router": ["dynamo_frontend_requests_total", "dynamo_router_decisions_total",
                      'dynamo_worker_prefill_requests_total{where="remote"}',
                      "dynamo_prefill_queue_wait_seconds_count",
                      "dynamo_worker_kv_transfers_total",
                      "dynamo_worker_kv_transfer_bytes_total",
                      "dynamo_worker_kv_transfer_seconds_count"],
}
"""Counters the driven traffic must have moved: a counter exported at 0 gives its panel
"data" too, so the panels alone would not show that, say, a KV transfer was counted."""


def _available(graph: str) -> bool:
    return (importlib.util.find_spec(f"graphs.{graph}") is not None
            and (REPO / "configs" / f"{graph}.yaml").exists())


GRAPHS = [pytest.param(g, marks=MARKS[g], id=g) for g in MARKS if _available(g)]
KNOWN_LINT = {f'{old} non-counter metrics should not have "_total" suffix'
              for old in PENDING_RENAMES}
THIRD_PARTY_PREFIX = "vllm:"
"""vLLM registers its own ``vllm:*`` metrics in the worker's registry; their names
(colons included, which promtool reserves for recording rules) are vLLM's to keep."""


def panels_for(graph: str) -> list[dash.PanelQuery]:
    req = requirements()
    out = []
    for name, d in dash.load_dashboards(DASHBOARDS).items():
        graphs = dash.panel_graphs(d, req[name])
        out += [q for q in dash.panel_queries(d, name) if graphs[q.title] == graph]
    return out


@pytest.fixture(scope="module", params=GRAPHS)
def running(request: pytest.FixtureRequest, model_dir: Path, etcd_url: str, nats_url: str,
            nats_service: LocalService | None, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[tuple[str, ServeProcess, Path, str]]:
    graph: str = request.param
    targets = tmp_path_factory.mktemp(f"sd-{graph}") / "targets.json"
    monitor = (nats_service.extra["monitor_url"] if nats_service is not None
               else os.environ.get("NATS_MONITOR_URL", ""))
    env = {**os.environ, "ETCD_ENDPOINTS": etcd_url, "NATS_SERVER": nats_url,
           "NATS_MONITOR_URL": monitor, "DYNAMO_PROMETHEUS_SD": str(targets),
           "PYTHONUNBUFFERED": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    sp = ServeProcess(serve_args(graph, model_dir), env)
    prom: PrometheusScript | None = None
    try:
        sp.wait_ready(240)
        sp.wait_for_line("prometheus targets: ", 10)
        prom = PrometheusScript(targets)
        url = prom.wait_url()
        yield graph, sp, targets, url
    finally:
        if prom is not None:
            assert prom.stop() == 0, "\n".join(prom.lines)
        code = sp.stop()
        assert code == 0, sp.output()[-3000:]
    # dynamo serve leaves only the static targets once the graph is gone.
    assert all(g["labels"]["job"] != "dynagraph" for g in json.loads(targets.read_text()))


def test_targets_file_lists_every_process(running: tuple[str, ServeProcess, Path, str]) -> None:
    graph, sp, targets, _ = running
    groups = json.loads(targets.read_text())
    jobs = {g["labels"]["job"] for g in groups}
    assert {"dynagraph", "etcd"} <= jobs
    if os.environ.get("NATS_SERVER") is None or os.environ.get("NATS_MONITOR_URL"):
        assert "nats" in jobs
    pids = {line.split(" pid=")[1].split()[0] for line in sp.lines if " pid=" in line and
            " metrics=" in line}
    assert len([g for g in groups if g["labels"]["job"] == "dynagraph"]) == len(pids) > 0


def test_promtool_clean_on_every_endpoint(running: tuple[str, ServeProcess, Path, str]) -> None:
    _, sp, targets, _ = running
    # Ours: every component process, the NATS exporter, the Frontend's HTTP /metrics
    # (etcd's own endpoint is upstream's and not checked).
    addresses = [t for g in json.loads(targets.read_text()) for t in g["targets"]
                 if g["labels"]["job"] in {"dynagraph", "nats"}]
    addresses.append(sp.url().removeprefix("http://"))
    problems = {}
    for address in addresses:
        findings = [f for f in promtool_check_metrics(metrics_text(address))
                    if f not in KNOWN_LINT and not f.startswith(THIRD_PARTY_PREFIX)]
        if findings:
            problems[address] = findings
    assert problems == {}


def test_every_panel_returns_data(running: tuple[str, ServeProcess, Path, str]) -> None:
    graph, sp, targets, prom = running
    expected = sum(len(g["targets"]) for g in json.loads(targets.read_text())) + 1
    wait_until(lambda: sum(t["health"] == "up" for t in active_targets(prom)) >= expected,
               60, f"{expected} healthy targets")
    model = next(line.split('"model": "')[1].split('"')[0] for line in sp.lines
                 if '"model": "' in line)
    drive_traffic(sp.url(), model, long_prompts=LONG_PROMPTS.get(graph, 0))
    queries = panels_for(graph)
    assert queries, f"no panel is assigned to {graph}"
    failures: list[str] = []
    for q in queries:
        expr = dash.concrete(q.expr)
        for name in sorted(dash.metric_names(q.expr)):
            try:
                wait_until(lambda n=name: query(prom, f'count({{__name__="{n}"}})'), 20,
                           f"series of {name}")
            except AssertionError:
                failures.append(f"{q.dashboard} / {q.title}: metric {name} has no series")
        try:
            wait_until(lambda e=expr: query(prom, e), 20, "data")
        except AssertionError:
            failures.append(f"{q.dashboard} / {q.title} [{q.ref_id}]: no data for {expr}")
    assert failures == [], "\n".join(failures)


def test_traffic_moved_the_counters(running: tuple[str, ServeProcess, Path, str]) -> None:
    graph, _, _, prom = running  # runs after test_every_panel_returns_data drove traffic
    for series in MOVED[graph]:
        wait_until(lambda s=series: query(prom, f"sum({s}) > 0"), 20, f"{series} > 0")
