"""Fixtures for tests that run a real vLLM engine with KV events (marker ``vllm``).

``AsyncLLM`` always runs its EngineCore in a child process (vLLM 0.32 ignores
``VLLM_ENABLE_V1_MULTIPROCESSING`` there); ``llm.shutdown()`` stops it. The model is a
throwaway tiny Llama with random weights, fed token ids directly (no tokenizer).
"""

from __future__ import annotations

import gc
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

BLOCK_SIZE = 32
VOCAB = 512

_ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (head_dim 64: the CPU attention needs it) with random weights saved as safetensors (about a second)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def engine_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in _ENGINE_ENV}
    os.environ.update(_ENGINE_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def kv_sub() -> Iterator[tuple[zmq.asyncio.Socket, str]]:
    """A SUB socket bound to 127.0.0.1 on a free port; vLLM's PUB connects to it."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.fixture(scope="session")
async def vllm_engine(
    tiny_llama_dir: Path, engine_env: None, kv_sub: tuple[zmq.asyncio.Socket, str]
) -> AsyncIterator[Any]:
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    _, endpoint = kv_sub
    args = AsyncEngineArgs(
        model=str(tiny_llama_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_seqs=8,
        enable_prefix_caching=True,
        dtype="bfloat16",
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"
        ),
    )
    llm = AsyncLLM.from_engine_args(args)
    try:
        yield llm
    finally:
        llm.shutdown()
        # Drop it now: AsyncLLM.__del__ at interpreter exit fails noisily.
        del llm
        gc.collect()
