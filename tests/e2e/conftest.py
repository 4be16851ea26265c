"""A real agg graph (`dynamo serve graphs.agg:Frontend`) shared by the e2e tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.serve import ServeProcess

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="package")
def agg_graph(model_dir: Path, etcd_url: str, nats_url: str) -> Iterator[ServeProcess]:
    env = {**os.environ, "ETCD_ENDPOINTS": etcd_url, "NATS_SERVER": nats_url,
           "PYTHONUNBUFFERED": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    sp = ServeProcess(
        ["graphs.agg:Frontend", "-f", "configs/agg.yaml", "--Frontend.port=0",
         f"--Common.model={model_dir}", f"--Frontend.max-model-len={MAX_MODEL_LEN}",
         f"--Processor.max-model-len={MAX_MODEL_LEN}", f"--VllmWorker.max-model-len={MAX_MODEL_LEN}",
         f"--Processor.model={model_dir}", f"--VllmWorker.model={model_dir}"],
        env,
    )
    try:
        sp.wait_ready(180)
        yield sp
    finally:
        code = sp.stop()
        assert code == 0, sp.output()[-3000:]


@pytest.fixture(scope="package")
def base_url(agg_graph: ServeProcess) -> str:
    return agg_graph.url()
