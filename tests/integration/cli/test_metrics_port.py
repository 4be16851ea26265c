"""A component process with ``DYNAMO_METRICS_PORT`` serves its metrics on exactly that port,
and a second process on the same host and port fails with a message saying why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from dynagraph.runtime.infra import free_port

pytestmark = pytest.mark.integration

SERVE = ("import sys; from dynagraph.cli.child import start_metrics_server\n"
         "try:\n    print(start_metrics_server(), flush=True)\n"
         "except Exception as exc:\n    print(f'{type(exc).__name__}: {exc}', flush=True)\n"
         "    sys.exit(3)\n"
         "sys.stdin.read()\n")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
        for stream in (p.stdin, p.stdout):
            if stream is not None:
                stream.close()


def _start(procs: list[subprocess.Popen[str]], port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "DYNAMO_METRICS_PORT": str(port), "DYNAMO_HOST": "127.0.0.1"}
    p = subprocess.Popen([sys.executable, "-c", SERVE], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    procs.append(p)
    return p


def test_fixed_port_serves_metrics_and_a_second_bind_fails(
        procs: list[subprocess.Popen[str]]) -> None:
    port = free_port()
    first = _start(procs, port)
    assert first.stdout is not None
    assert first.stdout.readline().strip() == f"127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            resp = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert resp.status_code == 200 and "python_info" in resp.text
    second = _start(procs, port)
    assert second.stdout is not None
    line = second.stdout.readline().strip()
    assert second.wait(timeout=30) == 3
    assert line.startswith(f"InfraError: cannot serve metrics on 127.0.0.1:{port} "
                           "(DYNAMO_METRICS_PORT)")
    assert "one worker per host" in line
