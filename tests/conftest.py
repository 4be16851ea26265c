"""Session-wide fixtures: real etcd and NATS started by the project's own launcher.

Set ETCD_ENDPOINTS / NATS_SERVER to use already-running services instead.
"""

from __future__ import annotations

import multiprocessing.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService, start_etcd, start_nats

pytest_plugins = ["tests.support.heartbeat"]  # a line when a long run goes quiet (CI logs)

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "models" / "tiny-llama"


@pytest.fixture(scope="session", autouse=True)
def _private_tmpdir() -> Iterator[Path]:
    """One temp directory for everything the tests start (served graphs and their vLLM
    engines, etcd, NATS), removed at the end: vLLM's IPC sockets and ``vllm_dist_*``
    directories were left in the system temp dir, several hundred per run."""
    root = Path(tempfile.mkdtemp(prefix="dynagraph-tests-"))
    # multiprocessing's own directory (fork server sockets) stays outside: it removes
    # it when this process exits, after the session's teardown removed ``root``.
    multiprocessing.util.get_temp_dir()
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(root)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    try:
        yield root
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved
        tempfile.tempdir = None
        shutil.rmtree(root, ignore_errors=True)


def _service(env: str, start: Callable[[], LocalService]) -> Iterator[LocalService | None]:
    """A local service for the whole session, or None when ``env`` names one already."""
    if os.environ.get(env):
        yield None
        return
    svc = start()
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def etcd_service() -> Iterator[LocalService | None]:
    """A local etcd for the whole test session (None when ETCD_ENDPOINTS is set)."""
    yield from _service("ETCD_ENDPOINTS", start_etcd)


@pytest.fixture(scope="session")
def etcd_url(etcd_service: LocalService | None) -> str:
    """``http://127.0.0.1:PORT`` of the session's etcd."""
    return etcd_service.url if etcd_service else os.environ["ETCD_ENDPOINTS"].split(",")[0]


@pytest.fixture(scope="session")
def nats_service() -> Iterator[LocalService | None]:
    """A local nats-server with JetStream for the whole session (None when NATS_SERVER is set)."""
    yield from _service("NATS_SERVER", start_nats)


@pytest.fixture(scope="session")
def nats_url(nats_service: LocalService | None) -> str:
    """``nats://127.0.0.1:PORT`` of the session's NATS."""
    return nats_service.url if nats_service else os.environ["NATS_SERVER"]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE tokenizer with a chat template (HF format), built in < 1 s."""
    from tests.support.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tok"))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny local Llama model (the README's path), built on first use (~2 minutes)."""
    from tools.model_builder import ensure_model

    return ensure_model(MODEL_DIR)


@pytest.fixture
def restored_env() -> Iterator[None]:
    """``os.environ`` put back after the test: ``prepare_nixl`` and an engine's start set
    the engine's environment in this process, and no later test's engine may inherit it."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
