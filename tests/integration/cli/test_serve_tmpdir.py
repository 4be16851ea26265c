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
        assert private.name.startswith("dg-")
        assert private.parent == Path(tempfile.gettempdir())
    assert not private.exists()


def test_a_tmpdir_too_deep_for_unix_sockets_is_replaced_by_one_in_tmp(tmp_path: Path) -> None:
    from dynagraph.cli.serve_children import IPC_NAME_LEN, IPC_PATH_MAX, children_tmpdir

    short = children_tmpdir(tempfile.gettempdir())
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    far = children_tmpdir(str(deep))
    try:
        assert Path(short.name).parent == Path(tempfile.gettempdir())
        assert Path(far.name).parent == Path("/tmp")
        assert len(far.name) + IPC_NAME_LEN <= IPC_PATH_MAX
    finally:
        short.cleanup()
        far.cleanup()
