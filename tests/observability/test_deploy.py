"""deploy/: docker-compose.yml validates, every mounted file exists, configs parse.

`docker compose config` needs no engine. The compose binary used here is Debian's
`docker-compose` package (1.29.2, `apt-get install -y docker-compose`); the Compose v2
plugin (`docker compose`) is used instead when it is on PATH.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import DEPLOY, promtool

COMPOSE = DEPLOY / "docker-compose.yml"


def compose_command() -> list[str]:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 check=False, timeout=30).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy:
        return [legacy]
    pytest.skip("no compose binary: apt-get install -y docker-compose (Debian) to run this check")


def run_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*compose_command(), "-f", str(path), "config", "-q"],
                          capture_output=True, text=True, timeout=60, check=False)


def test_compose_config_validates() -> None:
    res = run_config(COMPOSE)
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_config_rejects_a_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE.read_text().replace("    network_mode: host\n",
                                               "    network_mode: host\n    bogus_key: 1\n", 1))
    assert run_config(bad).returncode != 0


def _compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load(COMPOSE.read_text())


def test_every_bind_mount_exists() -> None:
    compose = _compose()
    named = set(compose.get("volumes") or {})
    mounts = 0
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source in named:
                continue
            mounts += 1
            assert (DEPLOY / source).exists(), f"{name}: {source} does not exist under deploy/"
    assert mounts >= 4


def test_images_pinned_healthchecks_loopback() -> None:
    compose = _compose()
    assert {"etcd", "nats", "nats-exporter", "prometheus", "grafana"} <= set(compose["services"])
    for name, svc in compose["services"].items():
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned {image}"
        assert svc.get("network_mode") == "host", name
        assert "ports" not in svc, name
        if name != "nats-exporter":
            assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
    text = COMPOSE.read_text()
    assert "0.0.0.0" not in text


def test_prometheus_config_checks() -> None:
    res = subprocess.run([promtool(), "check", "config", "--syntax-only",
                          str(DEPLOY / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_grafana_provisioning() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [d["uid"] for d in ds] == ["dynagraph-prometheus"]
    providers = yaml.safe_load((prov / "dashboards" / "dynagraph.yml").read_text())["providers"]
    path = providers[0]["options"]["path"]
    grafana = _compose()["services"]["grafana"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert (DEPLOY / mounted[path]).resolve() == (DEPLOY / "grafana" / "dashboards").resolve()
