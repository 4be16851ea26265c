"""``deploy/k8s/prometheus-k8s.yml`` finds every generated pod once, with the labels the
dashboards use.

Debian's promtool is built without Kubernetes service discovery, so promtool checks the
file with its ``kubernetes_sd_configs`` swapped for a static target (the relabel rules are
what is checked), and the rules are applied here, the way Prometheus applies them, to the
targets Kubernetes discovery would produce for the generated pods.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import REPO, manifests_for

CONFIG = REPO / "deploy" / "k8s" / "prometheus-k8s.yml"


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _discovered(manifests: list[dict[str, Any]]) -> list[dict[str, str]]:
    """What kubernetes_sd (role: pod) yields: one target per declared container port."""
    out = []
    for w in (m for m in manifests if m["kind"] in ("Deployment", "StatefulSet")):
        template = w["spec"]["template"]
        base = {"__meta_kubernetes_namespace": w["metadata"]["namespace"],
                "__meta_kubernetes_pod_name": f"{w['metadata']['name']}-0"}
        for k, v in template["metadata"]["labels"].items():
            base[f"__meta_kubernetes_pod_label_{_sanitize(k)}"] = v
        for k, v in template["metadata"].get("annotations", {}).items():
            base[f"__meta_kubernetes_pod_annotation_{_sanitize(k)}"] = v
        for c in template["spec"]["containers"]:
            for p in c.get("ports", []):
                out.append({**base, "__address__": f"10.1.2.3:{p['containerPort']}",
                            "__meta_kubernetes_pod_container_port_name": p["name"],
                            "__metrics_path__": "/metrics", "job": "dynagraph"})
    return out


def _relabel(target: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' relabelling for the actions and defaults the file uses."""
    labels = dict(target)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(s, "")
                                                for s in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                labels[rule["target_label"]] = match.expand(
                    rule.get("replacement", "$1").replace("$", "\\"))
        else:
            raise AssertionError(f"action {action} not simulated here")
    return {k: v for k, v in labels.items() if not k.startswith("__meta_")}


def _rules() -> list[dict[str, Any]]:
    (job,) = yaml.safe_load(CONFIG.read_text())["scrape_configs"]
    rules: list[dict[str, Any]] = job["relabel_configs"]
    return rules


def test_every_pod_is_one_target_with_the_dashboards_labels() -> None:
    manifests = manifests_for("disagg_router")
    targets = [t for t in (_relabel(d, _rules()) for d in _discovered(manifests)) if t]
    got = sorted((t["job"], t.get("component", ""), t["__address__"]) for t in targets)
    assert got == [
        ("dynagraph", "Frontend", "10.1.2.3:9090"),
        ("dynagraph", "PrefillWorker", "10.1.2.3:9090"),
        ("dynagraph", "Processor", "10.1.2.3:9090"),
        ("dynagraph", "Router", "10.1.2.3:9090"),
        ("dynagraph", "VllmWorker", "10.1.2.3:9090"),
        ("etcd", "", "10.1.2.3:2381"),
        ("nats", "", "10.1.2.3:7777"),
    ]
    for t in targets:
        assert t["graph"] == "disagg-router" and t["kubernetes_namespace"] == "dynagraph"
        assert t["__metrics_path__"] == "/metrics"
        if t["job"] == "dynagraph":
            assert t["namespace"] == "dynamo"


def test_unrelated_pods_are_not_scraped() -> None:
    other = {"__address__": "10.9.9.9:9090", "__meta_kubernetes_pod_container_port_name":
             "metrics", "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
             "__meta_kubernetes_pod_label_app_kubernetes_io_part_of": "something-else"}
    assert _relabel(other, _rules()) is None


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: apt-get install -y prometheus (scripts/install.sh does)")
    cfg = yaml.safe_load(CONFIG.read_text())
    for job in cfg["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        job["static_configs"] = [{"targets": ["127.0.0.1:9090"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    res = subprocess.run([promtool, "check", "config", str(path)], capture_output=True,
                         text=True, timeout=30, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
