"""``dynamo status`` on the real agg graph: the worker's load columns come from its vLLM
engine's metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.serve import REPO, ServeProcess

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def test_status_shows_the_vllm_workers_load(agg_graph: ServeProcess, etcd_url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dynagraph.cli.main", "status", "--json", "--etcd", etcd_url,
         "--namespace", "dynamo"], cwd=REPO, capture_output=True, text=True, timeout=60,
        check=False)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert {n: c["ready"] for n, c in snap["components"].items()} == {
        "Frontend": 1, "Processor": 1, "VllmWorker": 1}
    [worker] = [i for i in snap["instances"] if i["component"] == "VllmWorker"]
    assert worker["health"] == "ok"
    load = worker["load"]
    assert load["kv_total_blocks"] > 0  # the engine's KV cache, in blocks of 32 tokens
    assert (load["running"], load["waiting"]) == (0, 0)
    assert 0.0 <= load["kv_usage"] <= 1.0
    assert [i["load"] for i in snap["instances"] if i["component"] != "VllmWorker"] == [None, None]
