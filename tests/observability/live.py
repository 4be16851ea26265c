"""Helpers of the live dashboard test: the graph, Prometheus (scripts/prometheus.sh), traffic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import httpx

from tests.support.serve import REPO, ServeProcess

MAX_MODEL_LEN = 1024


def serve_args(graph: str, model_dir: Path) -> list[str]:
    """``dynamo serve`` arguments for graphs.<graph> on the test model, Frontend on port 0."""
    from dynagraph.sdk._config import resolve_config
    from dynagraph.sdk._graph import resolve_target

    config = f"configs/{graph}.yaml"
    target = f"graphs.{graph}:Frontend"
    resolved = resolve_config(resolve_target(target), str(REPO / config), [])
    args = [target, "-f", config, "--Frontend.port=0"]
    for name, cfg in resolved.items():
        if "model" in cfg.values:
            args.append(f"--{name}.model={model_dir}")
        if "max-model-len" in cfg.values:
            args.append(f"--{name}.max-model-len={MAX_MODEL_LEN}")
    return args


class PrometheusScript:
    """``scripts/prometheus.sh TARGETS`` in its own session, stopped by its PID."""

    def __init__(self, targets: Path, scrape_interval: str = "1s") -> None:
        env = {**os.environ, "PROMETHEUS_PORT": "0", "PROMETHEUS_SCRAPE_INTERVAL": scrape_interval}
        self.proc = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "prometheus.sh"), str(targets)], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def wait_url(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if line.startswith("prometheus ready at "):
                    return line.split()[3]
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError("prometheus.sh did not become ready:\n" + "\n".join(self.lines))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        return self.proc.returncode


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - loopback
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def active_targets(prom: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{prom}/api/v1/targets?state=active", timeout=10) as resp:  # noqa: S310
        return list(json.loads(resp.read())["data"]["activeTargets"])


def wait_until(cond: Any, timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def long_prompt(i: int, sentences: int = 40) -> str:
    """~700 tokens of the test model, distinct from its first word (no shared prefix)."""
    return f"Request number {i}. " + "Dashboards plot what the graph exports. " * sentences


def drive_traffic(base_url: str, model: str, rounds: int = 3, long_prompts: int = 0) -> None:
    """Streamed and unary chat/completions, one bad request, one client disconnect, and
    ``long_prompts`` completions long enough for a remote prefill in the disagg graph."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for i in range(long_prompts):
            r = client.post("/v1/completions", json={"model": model, "prompt": long_prompt(i),
                                                     "max_tokens": 4})
            assert r.status_code == 200, r.text
        for i in range(rounds):
            prompt = "The quick brown fox jumps over the lazy dog. " * (4 + i)
            for stream in (True, False):
                r = client.post("/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 16, "stream": stream})
                assert r.status_code == 200, r.text
            r = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                     "max_tokens": 8})
            assert r.status_code == 200, r.text
        bad = client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0})
        assert bad.status_code == 400, bad.text
        with client.stream("POST", "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Count to a thousand."}],
                "max_tokens": 200, "stream": True}) as resp:
            for _ in resp.iter_lines():
                break  # disconnect after the first line


def metrics_text(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:  # noqa: S310
        return resp.read().decode()


__all__ = ["ServeProcess", "PrometheusScript", "active_targets", "drive_traffic",
           "metrics_text", "query", "serve_args", "wait_until"]
