"""Run ``dynamo serve`` as a real subprocess against the session's etcd/NATS."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.serve import ServeProcess


@pytest.fixture
def serve_env(etcd_url: str, nats_url: str) -> dict[str, str]:
    return {**os.environ, "ETCD_ENDPOINTS": etcd_url, "NATS_SERVER": nats_url,
            "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def run_serve(serve_env: dict[str, str]) -> Iterator[object]:
    started: list[ServeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServeProcess:
        sp = ServeProcess(list(args), env or serve_env)
        started.append(sp)
        return sp

    yield start
    for sp in started:
        sp.stop()
