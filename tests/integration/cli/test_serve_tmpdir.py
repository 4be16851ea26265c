"""``dynamo serve`` gives its components a private TMPDIR and removes it when it stops:
vLLM's IPC sockets and other temporary files do not pile up in /tmp."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.support.serve import graph_env, served

pytestmark = pytest.mark.integration


def test_components_get_a_private_tmpdir_removed_at_exit(
        etcd_url: str, nats_url: str, tmp_path: Path) -> None:
    report = tmp_path / "tmpdir.txt"
    env = {**graph_env(etcd_url, nats_url), "TMPDIR_REPORT": str(report)}
    with served(["tests.integration.cli.tmp_graph:Reporter"], env, ready_timeout=60):
        private = Path(report.read_text())
        assert private.is_dir()
        assert private.parent.name.startswith("dynamo-serve-")
        assert private.parent.parent == Path(tempfile.gettempdir())
    assert not private.exists() and not private.parent.exists()
