"""The mocker's scheduler and block pool against vLLM's own, step by step.

One scripted workload (shared prefixes, chunked prefill, a KV cache small enough to
evict and preempt) runs through vLLM v1's in-process engine and through the mocker's
``Scheduler`` with the same settings. Every step must schedule the same tokens for the
same requests and produce the same KV events. Block hashes of blocks that hold
generated tokens differ (vLLM's tokens come from the model, the mocker's from its
seed), so the events are compared with those hashes replaced by a placeholder; hashes
of prompt blocks are compared exactly.
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynagraph.llm.engines.mocker.scheduler import Scheduler, SchedulerConfig
from dynagraph.llm.engines.mocker.sequence import Sequence, TokenSource
from dynagraph.llm.router.events import BlocksRemoved, BlocksStored, KvEvent
from dynagraph.llm.router.hashing import BlockHasher, seed_from_env

pytestmark = pytest.mark.vllm

BS = 32
BLOCKS = 24  # 23 usable: small enough to evict cached blocks and preempt
BUDGET = 64
MAX_SEQS = 8
MAX_LEN = 512


class _Recorder:
    """Stands in for vLLM's KV event publisher: keeps each step's batch."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(list(batch.events))

    def shutdown(self) -> None:
        return None


def _build(model_dir: Path) -> Any:
    from vllm import EngineArgs
    from vllm.config import KVEventsConfig
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), block_size=BS, enforce_eager=True,
        enable_prefix_caching=True, max_model_len=MAX_LEN,
        max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
        num_gpu_blocks_override=BLOCKS, seed=0, disable_log_stats=True,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    ))


@pytest.fixture(scope="module")
def vllm_core(model_dir: Path) -> Iterator[Any]:
    """vLLM's LLMEngine with its engine core in this process, events recorded."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                             "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # vLLM's import and start trip them
            engine = _build(model_dir)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield engine
    engine.engine_core.shutdown()


def _workload() -> dict[int, list[tuple[str, list[int], int]]]:
    """Arrivals before step k: (request id, prompt, max_tokens)."""
    rng = random.Random(7)

    def toks(n: int) -> list[int]:
        return [rng.randrange(5, 2048) for _ in range(n)]

    a = toks(100)
    return {
        0: [("A", a, 1), ("B", toks(40), 8)],
        2: [("C", a[:96] + toks(50), 3)],          # hits A's first 3 blocks (2 cached)
        3: [("D", toks(200), 20)],
        4: [("E", toks(150), 20), ("F", a[:64] + toks(10), 2)],
        6: [("G", toks(300), 30)],                  # does not fit beside D and E
        9: [("H", a + toks(5), 2)],                 # A's blocks, if they survived
        # four short prompts that decode long: together they outgrow the cache
        12: [(f"L{i}", toks(40), 200) for i in range(4)],
    }


def _label(h: int, prompt_hashes: set[int]) -> int | str:
    return h if h in prompt_hashes else "generated"


def _normalise(events: list[Any], prompt_hashes: set[int]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for ev in events:
        kind = type(ev).__name__
        if kind in ("BlockStored", "BlocksStored"):
            parent = ev.parent_block_hash if kind == "BlockStored" else ev.parent_hash
            out.append(("stored", [_label(h, prompt_hashes) for h in ev.block_hashes],
                        None if parent is None else _label(parent, prompt_hashes),
                        ev.block_size))
        elif kind in ("BlockRemoved", "BlocksRemoved"):
            out.append(("removed", [_label(h, prompt_hashes) for h in ev.block_hashes]))
        else:
            out.append((kind,))
    return out


def test_same_steps_and_events_as_vllm(vllm_core: Any) -> None:
    from vllm import SamplingParams

    core = vllm_core.engine_core.engine_core
    recorder = _Recorder()
    core.scheduler.kv_event_publisher = recorder
    scheduled_vllm: list[dict[str, int]] = []
    schedule = core.scheduler.schedule

    def recording_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        scheduled_vllm.append({rid.rsplit("-", 1)[0]: n
                               for rid, n in out.num_scheduled_tokens.items()})
        return out

    core.scheduler.schedule = recording_schedule

    hasher = BlockHasher(BS, "sha256", seed_from_env(os.environ))
    mock = Scheduler(SchedulerConfig(num_gpu_blocks=BLOCKS, block_size=BS,
                                     max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET))
    prompt_hashes: set[int] = set()
    arrivals = _workload()
    mock_events: list[list[KvEvent]] = []
    scheduled_mock: list[dict[str, int]] = []
    preempted = 0
    for step in range(1000):
        for rid, prompt, max_tokens in arrivals.get(step, []):
            prompt_hashes.update(hasher.block_hashes(prompt))
            vllm_core.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False))
            mock.add(Sequence(rid, prompt, max_tokens=max_tokens, hasher=hasher,
                              tokens=TokenSource(step, 2048)))
        busy = vllm_core.has_unfinished_requests()
        assert busy == bool(mock.requests), f"step {step}"
        if not busy:
            if step > max(arrivals):
                break
            continue
        n_batches = len(recorder.batches)
        vllm_core.step()
        vllm_events = recorder.batches[n_batches] if len(recorder.batches) > n_batches else []
        result = mock.step()
        preempted += len(result.preempted)
        scheduled_mock.append(result.scheduled)
        mock_events.append(result.events)
        assert scheduled_mock[-1] == scheduled_vllm[-1], f"step {step}"
        assert (_normalise(result.events, prompt_hashes)
                == _normalise(vllm_events, prompt_hashes)), f"step {step}"
    assert not mock.requests and not vllm_core.has_unfinished_requests()
    # the workload exercised what it is for
    flat = [e for batch in mock_events for e in batch]
    assert any(isinstance(e, BlocksRemoved) for e in flat), "no eviction happened"
    assert preempted, "no preemption happened"
    assert any(isinstance(e, BlocksStored) and e.parent_hash is not None for e in flat)
    assert any(0 < n < BUDGET and n > 1 for s in scheduled_mock for n in s.values())
