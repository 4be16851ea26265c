"""``dynamo serve`` keeps a Prometheus file_sd file current from etcd (no vLLM needed).

The demo graph (Entry -> Relay -> Source x2) with the etcd and nats-server that
``dynamo serve`` starts itself: the file lists every process, etcd and the NATS
exporter; every listed endpoint serves metrics; a process that is killed and
restarted is replaced in the file by its new address; on exit only the static
targets remain.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.support.serve import ServeProcess

from .conftest import promtool_check_metrics
from .live import metrics_text, wait_until

pytestmark = pytest.mark.integration

TARGET = "tests.integration.sdk.demo_graph:Entry"


def _groups(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return json.loads(path.read_text())


def _graph_targets(path: Path) -> dict[str, str]:
    """{address: component} of the graph's processes in the file."""
    return {g["targets"][0]: g["labels"]["component"] for g in _groups(path)
            if g["labels"]["job"] == "dynagraph"}


def test_targets_follow_the_graph(tmp_path: Path) -> None:
    config = tmp_path / "demo.yaml"
    config.write_text("Source:\n  ServiceArgs:\n    workers: 2\n")
    targets = tmp_path / "targets" / "demo.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("ETCD_ENDPOINTS", "NATS_SERVER", "NATS_MONITOR_URL")}
    env.update({"PYTHONUNBUFFERED": "1", "DYNAMO_PROMETHEUS_SD": str(targets)})
    sp = ServeProcess([TARGET, "-f", str(config)], env)
    try:
        sp.wait_ready(60)
        line = sp.wait_for_line("prometheus targets: ", 10)
        assert str(targets) in line and "scripts/prometheus.sh" in line
        assert sorted(_graph_targets(targets).values()) == ["Entry", "Relay", "Source", "Source"]
        jobs = sorted(g["labels"]["job"] for g in _groups(targets))
        assert jobs.count("etcd") == 1 and jobs.count("nats") == 1
        for g in _groups(targets):
            text = metrics_text(g["targets"][0])
            if g["labels"]["job"] == "nats":
                assert "gnatsd_varz_connections{" in text
            if g["labels"]["job"] != "etcd":
                assert promtool_check_metrics(text) == [], g

        # A Source process dies; dynamo serve restarts it: the file follows, no edit.
        source_pid = int(next(ln.split(" pid=")[1].split()[0] for ln in sp.lines
                              if ln.strip().startswith("Source[0] pid=")))
        before = {a for a, c in _graph_targets(targets).items() if c == "Source"}
        os.kill(source_pid, signal.SIGKILL)
        wait_until(lambda: len(before & set(_graph_targets(targets))) == 1, 15,
                   "the killed Source to leave the file")
        wait_until(lambda: list(_graph_targets(targets).values()).count("Source") == 2, 30,
                   "the restarted Source to join the file")
        assert len({a for a, c in _graph_targets(targets).items() if c == "Source"} - before) == 1
    finally:
        code = sp.stop()
    assert code == 0, sp.output()[-2000:]
    assert _graph_targets(targets) == {}
    assert [g["labels"]["job"] for g in _groups(targets)] in (["etcd", "nats"], ["nats", "etcd"])
