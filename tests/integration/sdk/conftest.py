"""Run ``dynamo serve`` as a real subprocess against the session's etcd/NATS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


class ServeProcess:
    """``dynamo serve`` in its own session; its output is collected in ``lines``."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynagraph.cli.main", "serve", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, needle: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if needle in line:
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"no line containing {needle!r}; output:\n{self.output()}")

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
        return self.proc.returncode


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
