"""Shared paths and helpers for the observability tests."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.support.serve import REPO

DEPLOY = REPO / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
REQUIREMENTS = DEPLOY / "grafana" / "requirements.yaml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources"


def datasource_uids() -> set[str]:
    uids: set[str] = set()
    for path in DATASOURCES.glob("*.y*ml"):
        for ds in yaml.safe_load(path.read_text()).get("datasources", []):
            uids.add(str(ds["uid"]))
    return uids


def requirements() -> dict[str, dict]:
    return yaml.safe_load(REQUIREMENTS.read_text())


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: apt-get install -y prometheus (scripts/install.sh does)")
    return path


def promtool_check_metrics(text: str) -> list[str]:
    """promtool's lint findings for a metrics exposition (empty: clean)."""
    res = subprocess.run([promtool(), "check", "metrics"], input=text.encode(),
                         capture_output=True, timeout=30, check=False)
    out = (res.stdout + res.stderr).decode().strip()
    if res.returncode not in (0, 3) or (res.returncode == 3 and not out):
        raise AssertionError(f"promtool check metrics failed ({res.returncode}): {out}")
    return [line for line in out.splitlines() if line.strip()]
