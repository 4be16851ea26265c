"""A real agg graph (`dynamo serve graphs.agg:Frontend`) shared by the e2e tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.serve import ServeProcess, graph_env, served

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="package")
def agg_graph(model_dir: Path, etcd_url: str, nats_url: str) -> Iterator[ServeProcess]:
    with served(["graphs.agg:Frontend", "-f", "configs/agg.yaml", "--Frontend.port=0",
                 f"--Common.model={model_dir}", f"--Common.max-model-len={MAX_MODEL_LEN}"],
                graph_env(etcd_url, nats_url, in_process_engines=True), ready_timeout=300) as sp:
        yield sp


@pytest.fixture(scope="package")
def base_url(agg_graph: ServeProcess) -> str:
    return agg_graph.url()


@pytest.fixture(scope="package")
def vllm_url(model_dir: Path) -> Iterator[str]:
    """vLLM's own OpenAI server on the same model (the anchor the API tests compare to)."""
    from tests.support.vllm_server import VllmServer

    server = VllmServer(model_dir, served_name="tiny-llama", max_model_len=MAX_MODEL_LEN)
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()
