"""Session fixtures for tests that run a real vLLM engine (marker ``vllm``).

The tiny model is built once into ``<repo>/models/tiny-llama`` (the README's path,
so a demo run and the tests share it). One engine serves the whole session.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.engines.vllm.engine import VllmEngine

TEST_BLOCK_SIZE = 32


@contextlib.contextmanager
def in_process_model() -> Iterator[None]:
    """Run the model inside vLLM's engine-core process (starts in seconds, decodes slower).

    Only set while an engine starts (its child process copies the environment), so
    processes that tests spawn later do not inherit it.
    """
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    saved = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


@pytest.fixture(scope="session")
def kv_events_endpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``ipc://`` endpoint the session engine publishes its KV events on."""
    return f"ipc://{tmp_path_factory.mktemp('kv')}/events.ipc"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(model_dir: Path, kv_events_endpoint: str) -> AsyncIterator[VllmEngine]:
    """One started engine shared by the session's ``vllm`` tests (block size 32)."""
    engine = VllmEngine(
        VllmEngineArgs(
            model=str(model_dir),
            block_size=TEST_BLOCK_SIZE,
            max_model_len=8192,
            max_num_seqs=16,
            kv_cache_space_gib=1,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_topic="test-engine",
        )
    )
    with in_process_model():
        await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()
