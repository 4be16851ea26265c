"""Helpers of the live dashboard test: the graph, Prometheus (scripts/prometheus.sh), traffic."""

from __future__ import annotations

import json
import os
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import httpx

from tests.support.metrics import scrape as metrics_text
from tests.support.poll import wait_until
from tests.support.process import OutputProcess
from tests.support.serve import REPO, ServeProcess

MAX_MODEL_LEN = 1024


def serve_args(graph: str, model_dir: Path) -> list[str]:
    """``dynamo serve`` arguments for graphs.<graph> on the test model, Frontend on port 0."""
    return [f"graphs.{graph}:Frontend", "-f", f"configs/{graph}.yaml", "--Frontend.port=0",
            f"--Common.model={model_dir}", f"--Common.max-model-len={MAX_MODEL_LEN}"]


class PrometheusScript(OutputProcess):
    """``scripts/prometheus.sh TARGETS`` in its own session, stopped by its PID."""

    def __init__(self, targets: Path, scrape_interval: str = "1s") -> None:
        env = {**os.environ, "PROMETHEUS_PORT": "0", "PROMETHEUS_SCRAPE_INTERVAL": scrape_interval}
        super().__init__(["bash", str(REPO / "scripts" / "prometheus.sh"), str(targets)], env)

    def wait_url(self, timeout: float = 60.0) -> str:
        return self.wait_for_line("prometheus ready at ", timeout).split()[3]


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - loopback
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def active_targets(prom: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{prom}/api/v1/targets?state=active", timeout=10) as resp:  # noqa: S310
        return list(json.loads(resp.read())["data"]["activeTargets"])


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


__all__ = ["ServeProcess", "PrometheusScript", "active_targets", "drive_traffic",
           "metrics_text", "query", "serve_args", "wait_until"]
