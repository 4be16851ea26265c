"""Session fixtures for tests that run a real vLLM engine (marker ``vllm``).

The tiny model is built once into ``<repo>/models/tiny-llama`` (the README's path,
so a demo run and the tests share it). One engine serves the whole session.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from dynagraph.llm.engines.vllm_engine import VllmEngine, VllmEngineArgs
from dynagraph.llm.model_builder import ensure_model

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_DIR = REPO / "models" / "tiny-llama"
TEST_BLOCK_SIZE = 32


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Path of the tiny Llama model, built on first use (about two minutes)."""
    return ensure_model(TINY_MODEL_DIR)


@pytest.fixture(scope="session")
def vllm_test_env() -> Iterator[None]:
    """Environment for in-test engines: model runs inside the engine-core process."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",)}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def kv_events_endpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``ipc://`` endpoint the session engine publishes its KV events on."""
    return f"ipc://{tmp_path_factory.mktemp('kv')}/events.ipc"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(
    tiny_model: Path, vllm_test_env: None, kv_events_endpoint: str
) -> AsyncIterator[VllmEngine]:
    """One started engine shared by the session's ``vllm`` tests (block size 32)."""
    engine = VllmEngine(
        VllmEngineArgs(
            model=str(tiny_model),
            block_size=TEST_BLOCK_SIZE,
            max_model_len=8192,
            max_num_seqs=16,
            kv_cache_space_gib=1,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_topic="test-engine",
        )
    )
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()
