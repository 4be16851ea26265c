"""MockerWorker and MockerPrefillWorker with in-memory fakes (constructor injection).

The worker is built as ``dynamo serve`` builds it, ``MockerWorker(config, runtime=...,
prefill=...)``, with in-memory discovery, queue and clients; its endpoints are called
as the request plane calls them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

import graphs.mocker_disagg
import graphs.mocker_router
from components.kv_router import Router
from components.mocker_prefill_worker import (
    KvFetched,
    MockerPrefillWorker,
    MockerPrefillWorkerConfig,
)
from components.mocker_worker import MockerWorker, MockerWorkerConfig
from components.processor import Processor
from dynagraph.errors import InvalidRequest, Requeued
from dynagraph.llm.disagg import PrefillResult
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.engines.mocker.serving import tokenizer_vocab
from dynagraph.llm.protocol import PreprocessedRequest, Release, Released, SamplingParams
from dynagraph.llm.router.events import RelayBatch
from dynagraph.llm.router.hashing import BlockHasher, seed_from_env
from dynagraph.runtime.discovery import MemoryDiscovery, MemoryStore
from dynagraph.runtime.queue import MemoryPrefillQueue
from dynagraph.sdk import RuntimeContext
from dynagraph.sdk.testing import in_memory_client
from tests.support.metrics import total
from tests.support.poll import until

BS = 32
SPEED = 50.0  # simulated durations / 50: a 4k prefill takes ~10 ms here


def config(tokenizer: Path, **kw: Any) -> MockerWorkerConfig:
    base: dict[str, Any] = dict(model=str(tokenizer), block_size=BS, max_model_len=2048,
                                speed=SPEED, publish_kv_events=True, num_gpu_blocks=512)
    return MockerWorkerConfig(**{**base, **kw})


def request(rid: str, tokens: list[int], max_tokens: int = 4) -> PreprocessedRequest:
    return PreprocessedRequest(request_id=rid, token_ids=tokens,
                               sampling=SamplingParams(max_tokens=max_tokens, temperature=0))


def prompt(tag: int, n: int) -> list[int]:
    return [10 + (tag * 7919 + i * 31) % 900 for i in range(n)]


async def collect(stream: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return [item async for item in stream]


async def runtime(store: MemoryStore, component: str) -> RuntimeContext:
    disc = MemoryDiscovery(store)
    await disc.start()
    return RuntimeContext(namespace="dynamo", component=component, worker_index=0,
                          instance_id=disc.instance_id, discovery=disc,
                          registry=CollectorRegistry())


@contextlib.asynccontextmanager
async def running(component: Any) -> AsyncIterator[Any]:
    await component.start()
    try:
        yield component
    finally:
        await component.stop()


async def test_generate_metadata_and_vocabulary_as_a_vllm_worker(tiny_tokenizer_dir: Path) -> None:
    store = MemoryStore()
    rt = await runtime(store, "MockerWorker")
    async with running(MockerWorker(config(tiny_tokenizer_dir), runtime=rt)) as worker:
        out = await collect(worker.generate(request("r1", prompt(1, 100), max_tokens=5)))
        assert [len(o.token_ids) for o in out] == [1] * 5
        assert (out[0].prompt_tokens, out[0].cached_tokens) == (100, 0)
        assert out[-1].finish_reason == "length" and out[-1].prompt_tokens == 100
        assert all(o.finish_reason is None for o in out[:-1])
        vocab, specials = tokenizer_vocab(str(tiny_tokenizer_dir))
        tokens = [t for o in out for t in o.token_ids]
        assert all(0 <= t < vocab and t not in specials for t in tokens)
        again = await collect(worker.generate(request("r2", prompt(1, 100), max_tokens=5)))
        assert [t for o in again for t in o.token_ids] == tokens  # greedy: same prompt
        assert again[0].cached_tokens == 96  # three full blocks from the prefix cache
        hasher = worker.engine.hasher
        assert {k: rt.metadata[k] for k in ("block_size", "max_model_len", "kv_events",
                                             "kv_hash_algo", "kv_hash_seed")} == {
            "block_size": BS, "max_model_len": 2048, "kv_events": True,
            "kv_hash_algo": "sha256", "kv_hash_seed": hasher.seed}
        assert hasher == BlockHasher(BS, "sha256", seed_from_env(os.environ))
        assert rt.metadata["engine"] == "mocker"
        assert {k: rt.metadata[k] for k in ("model", "model_path", "structured_outputs")} == {
            "model": tiny_tokenizer_dir.name, "model_path": str(tiny_tokenizer_dir),
            "structured_outputs": False}
        assert "max_logprobs" not in rt.metadata  # the Processor refuses logprobs for it
        assert worker.engine.engine_id == f"MockerWorker-{rt.instance_id:x}"
        label = f'worker="{rt.instance_id:x}"'
        text = _exposition(rt.registry)
        assert total(text, "dynamo_worker_prefix_cache_queries_total", label) == 200
        assert total(text, "dynamo_worker_prefix_cache_hits_total", label) == 96


async def test_release_hands_back_only_requests_waiting_for_a_place(
        tiny_tokenizer_dir: Path) -> None:
    rt = await runtime(MemoryStore(), "MockerWorker")
    cfg = config(tiny_tokenizer_dir, max_num_seqs=1, speed=1.0)
    async with running(MockerWorker(cfg, runtime=rt)) as worker:
        running_one = worker.generate(request("r1", prompt(1, 64), max_tokens=200))
        assert (await anext(running_one)).token_ids  # started: has a place
        waiting = asyncio.ensure_future(collect(worker.generate(request("r2", prompt(2, 64)))))
        await until(lambda: worker.engine.load().waiting == 1)
        assert await anext(worker.release(Release(count=5))) == Released(released=1)  # only the waiter
        with pytest.raises(Requeued):
            await waiting
        await until(lambda: worker.engine.load().waiting == 0)
        assert (await anext(running_one)).token_ids  # the running one goes on
        await running_one.aclose()  # type: ignore[attr-defined]
        assert await anext(worker.release(Release(count=1))) == Released(released=0)


async def test_kv_events_stream_a_snapshot_then_net_deltas(tiny_tokenizer_dir: Path) -> None:
    rt = await runtime(MemoryStore(), "MockerWorker")
    async with running(MockerWorker(config(tiny_tokenizer_dir), runtime=rt)) as worker:
        first = worker.kv_events({})
        assert RelayBatch.from_wire(await anext(first)) == RelayBatch(seq=0, snapshot=True)
        tokens = prompt(2, 4 * BS + 5)
        await collect(worker.generate(request("a", tokens, max_tokens=2)))
        stored: list[int] = []
        while len(stored) < 4:
            batch = RelayBatch.from_wire(await asyncio.wait_for(anext(first), 5))
            assert not batch.snapshot and not batch.removed
            stored += batch.stored
        assert stored == BlockHasher(BS).block_hashes(tokens)  # the Router's own hashes
        late = worker.kv_events({})
        snap = RelayBatch.from_wire(await anext(late))
        assert snap.snapshot and snap.stored == stored and snap.seq == worker.feed.seq
        await first.aclose()
        await late.aclose()
        assert worker.feed.num_subscribers() == 0


async def test_load_metrics_are_sent_when_they_change(tiny_tokenizer_dir: Path) -> None:
    rt = await runtime(MemoryStore(), "MockerWorker")
    cfg = config(tiny_tokenizer_dir, load_metrics_interval=0.005, speed=1.0)
    async with running(MockerWorker(cfg, runtime=rt)) as worker:
        loads = worker.load_metrics({})
        idle = EngineLoad.model_validate(await anext(loads))
        assert (idle.running, idle.kv_blocks_used, idle.kv_blocks_total) == (0, 0, 512)
        nothing = asyncio.ensure_future(anext(loads))
        await asyncio.sleep(0.05)  # ten samples, all equal: none is sent
        assert not nothing.done()
        gen = worker.generate(request("b", prompt(3, 1500), max_tokens=50))
        await anext(gen)  # the prefill took ~70 ms; the request now decodes
        busy = EngineLoad.model_validate(await asyncio.wait_for(nothing, 2))
        assert busy.running == 1 and busy.kv_blocks_used >= 1500 // BS
        await gen.aclose()
        await loads.aclose()


def test_it_stands_in_for_vllm_worker_and_prefill_worker() -> None:
    g = graphs.mocker_router.graph
    g.validate()
    assert g.edges(Processor) == {"router": Router, "worker": MockerWorker}
    assert g.edges(Router) == {"worker": MockerWorker}
    assert g.edges(MockerWorker) == {"prefill": None}
    d = graphs.mocker_disagg.graph
    d.validate()
    assert d.edges(MockerWorker) == {"prefill": MockerPrefillWorker}


class _Clients:
    """``RuntimeContext.clients`` for the prefill worker: calls go to local objects."""

    def __init__(self, decode: dict[int, MockerWorker]) -> None:
        self.decode = decode
        self.calls: list[tuple[str, str]] = []

    async def endpoint(self, namespace: str, component: str, endpoint: str, *,
                       response_type: type | None = None) -> Any:
        self.calls.append((component, endpoint))
        outer = self

        class Client:
            async def direct(self, msg: Any, instance_id: int) -> AsyncIterator[Any]:
                worker = outer.decode[instance_id]
                async for item in worker.prefill_done(msgspec.convert(msg, PrefillResult)):
                    yield item

        return Client()


def _prefill_client(worker: MockerPrefillWorker, instance_id: int,
                    fetched: list[str]) -> Any:
    """The decode worker's ``self.prefill``: one local MockerPrefillWorker; the requests
    its blocks were fetched for go to ``fetched``."""

    async def kv_fetched(msg: Any, iid: int) -> AsyncIterator[Any]:
        req = msgspec.convert(msg, KvFetched)
        fetched.append(req.request_id)
        async for item in worker.kv_fetched(req):
            yield item

    async def status(msg: Any, iid: int) -> AsyncIterator[Any]:
        yield {}

    return in_memory_client(MockerPrefillWorker, {"kv_fetched": kv_fetched, "status": status},
                            instance_ids=[instance_id])


async def test_remote_prefill_queue_handoff_and_simulated_transfer(
        tiny_tokenizer_dir: Path) -> None:
    store = MemoryStore()
    queue = MemoryPrefillQueue(ack_wait=3)
    drt, prt = await runtime(store, "MockerWorker"), await runtime(store, "MockerPrefillWorker")
    prefill = MockerPrefillWorker(MockerPrefillWorkerConfig(
        model=str(tiny_tokenizer_dir), block_size=BS, max_model_len=2048, speed=SPEED,
        num_gpu_blocks=512), runtime=prt)
    prefill.queue = queue
    fetched: list[str] = []
    client = _prefill_client(prefill, prt.instance_id, fetched)
    bandwidth = 0.1  # GB/s: 1,000 tokens x 2,048 bytes take 20 ms, 0.4 ms after speed 50
    decode = MockerWorker(config(tiny_tokenizer_dir, remote_prefill=True,
                                 max_local_prefill_length=256,
                                 kv_transfer_bandwidth_gbps=bandwidth),
                          runtime=drt, prefill=client)
    assert decode.disagg is not None
    decode.disagg.queue = queue
    prt.clients = _Clients({drt.instance_id: decode})  # type: ignore[assignment]
    async with running(prefill), running(decode):
        long_prompt = prompt(4, 1000)
        out = await collect(decode.generate(request("long", long_prompt, max_tokens=3)))
        assert out[-1].finish_reason == "length"
        assert sum(len(o.token_ids) for o in out) == 3
        assert out[0].cached_tokens == 1000  # the prompt's KV came from the peer (as vLLM counts)
        text = _exposition(drt.registry)
        label = f'worker="{drt.instance_id:x}"'
        assert total(text, "dynamo_worker_kv_transfers_total", label) == 1
        assert total(text, "dynamo_worker_kv_transfer_bytes_total", label) == 1000 * 2048
        assert total(text, "dynamo_worker_prefill_requests_total", 'where="remote"') == 1
        assert prefill.outcomes == {"handed-off": 1}
        assert prt.clients.calls == [("MockerWorker", "prefill_done")]  # type: ignore[union-attr]
        # The decode side told the producer its blocks were read: they are free again.
        await until(lambda: fetched == ["long-prefill-1"])
        await until(lambda: prefill.engine.load().kv_blocks_used == 0)
        short = await collect(decode.generate(request("short", prompt(5, 100), max_tokens=2)))
        assert short[0].cached_tokens == 0
        text = _exposition(drt.registry)
        assert total(text, "dynamo_worker_prefill_requests_total", 'where="local"') == 1
        assert total(text, "dynamo_worker_kv_transfers_total", label) == 1


def _exposition(registry: CollectorRegistry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


@pytest.mark.parametrize("n", [0, 1025])
def test_engines_per_process_is_bounded(tiny_tokenizer_dir: Path, n: int) -> None:
    with pytest.raises(ValueError, match="engines_per_process|engines-per-process"):
        config(tiny_tokenizer_dir, engines_per_process=n)


@pytest.mark.parametrize(("option", "value"), [("n", 2), ("logprobs", 1),
                                               ("prompt_logprobs", 0)])
async def test_options_it_cannot_honour_are_refused(tiny_tokenizer_dir: Path, option: str,
                                                    value: int) -> None:
    rt = await runtime(MemoryStore(), "MockerWorker")
    async with running(MockerWorker(config(tiny_tokenizer_dir), runtime=rt)) as worker:
        req = PreprocessedRequest(request_id="x", token_ids=prompt(6, 40), sampling=SamplingParams(
            max_tokens=2, temperature=0, **{option: value}))
        with pytest.raises(InvalidRequest, match=option):
            await collect(worker.generate(req))
        assert worker.engine.load().running == 0
