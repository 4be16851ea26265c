"""The disagg graph end to end: NIXL KV transfer, live thresholds, a killed prefill worker
whose job is redelivered.

All tests share one graph (``disagg_graph``) and run in file order; the kill test is
last because it restarts a prefill worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import pytest

from dynagraph.cli.core_keeper import split_processes
from dynagraph.runtime.queue import NatsPrefillQueue
from tests.e2e_disagg.conftest import (
    ACK_WAIT,
    KILL_PROMPT,
    PROMPTS,
    THRESHOLD,
    DisaggGraph,
    complete,
    text_of,
)
from tests.support.greedy import Greedy, assert_agrees
from tests.support.memory import anon_huge_kib

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

REMOTE = 'dynamo_worker_prefill_requests_total{reason="long-prompt",where="remote"}'
LOCAL = 'dynamo_worker_prefill_requests_total{reason="short-prompt",where="local"}'
TIMEOUT_FALLBACK = 'dynamo_worker_prefill_requests_total{reason="timeout",where="fallback"}'
EXTERNAL = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
COMPUTED = 'vllm:prompt_tokens_by_source_total{source="local_compute"}'
CACHE_HIT = 'vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum{}"
SETTING = "/dynamo/settings/VllmWorker/max-local-prefill-length"
HOLD = "/dynamo/settings/PrefillWorker/hold-before-reply-s"


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def run_one(g: DisaggGraph, prompt: str) -> tuple[dict[str, object], dict[str, float]]:
    """One request; returns the response and the decode worker's metric deltas."""
    before = g.metrics()
    body = complete(g.url, prompt)
    deadline = time.monotonic() + 5
    while True:  # vLLM records a step's stats right after its outputs; give it a moment
        after = g.metrics()
        moved = {k: delta(before, after, k) for k in set(before) | set(after)}
        if (moved.get(REMOTE, 0) + moved.get(LOCAL, 0) + moved.get(TIMEOUT_FALLBACK, 0) >= 1
                and moved.get(COMPUTED, 0) + moved.get(EXTERNAL, 0) + moved.get(CACHE_HIT, 0) > 0):
            return body, moved
        if time.monotonic() > deadline:
            return body, moved
        time.sleep(0.05)


def prompt_tokens(body: dict[str, object]) -> int:
    usage = body["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens"])


def test_greedy_output_equals_agg_and_kv_arrives_over_nixl(
    disagg_graph: DisaggGraph, agg_reference: dict[str, Greedy]
) -> None:
    remote = local = 0
    for p in PROMPTS:
        body, moved = run_one(disagg_graph, p.text)
        n = prompt_tokens(body)
        assert_agrees(agg_reference[p.text], text_of(body), f"{p.words} words / {n} tokens")
        if n > THRESHOLD:
            remote += 1
            assert moved.get(REMOTE) == 1, (n, moved)
            # every prompt token came over NIXL (or the local prefix cache), none computed here
            assert moved.get(COMPUTED, 0) == 0, (n, moved)
            assert moved.get(EXTERNAL, 0) + moved.get(CACHE_HIT, 0) == n, (n, moved)
            assert moved.get(EXTERNAL, 0) > 0 and moved.get(NIXL_BYTES, 0) > 0, (n, moved)
        else:
            local += 1
            assert moved.get(LOCAL) == 1, (n, moved)
            assert moved.get(EXTERNAL, 0) == 0 and moved.get(COMPUTED, 0) > 0, (n, moved)
    assert remote >= 10 and local >= 8, (remote, local)


def test_nixl_endpoints_are_registered_under_the_leases(disagg_graph: DisaggGraph) -> None:
    out = disagg_graph.etcdctl("get", "--prefix", "/dynamo/nixl/")
    assert "/dynamo/nixl/VllmWorker/" in out and "/dynamo/nixl/PrefillWorker/" in out
    assert '"role":"kv_producer"' in out and '"role":"kv_consumer"' in out
    leases = disagg_graph.etcdctl("get", "--prefix", "/dynamo/nixl/", "-w", "json")
    assert '"lease":' in leases


def fresh(words: int, seed: str) -> str:
    return " ".join(f"{seed}{i % 37}" for i in range(words))


def test_live_threshold_switches_local_and_remote(disagg_graph: DisaggGraph) -> None:
    g = disagg_graph
    try:
        body, moved = run_one(g, fresh(300, "ab"))
        assert prompt_tokens(body) > THRESHOLD and moved.get(REMOTE) == 1, moved
        g.etcdctl("put", SETTING, "100000")
        deadline = time.monotonic() + 10
        while True:  # the watch applies the new value within milliseconds
            body, moved = run_one(g, fresh(300, f"cd{int(time.monotonic() * 1000)}"))
            if moved.get(LOCAL) == 1 or time.monotonic() > deadline:
                break
        assert moved.get(LOCAL) == 1 and moved.get(EXTERNAL, 0) == 0, moved
    finally:
        g.etcdctl("del", SETTING)
    deadline = time.monotonic() + 10
    while True:
        body, moved = run_one(g, fresh(300, f"ef{int(time.monotonic() * 1000)}"))
        if moved.get(REMOTE) == 1 or time.monotonic() > deadline:
            break
    assert moved.get(REMOTE) == 1, moved  # deleted key: back to the config file's 256


async def queue_stats(q: NatsPrefillQueue) -> tuple[int, int]:
    s = await q.stats()
    return s.waiting, s.in_flight


def prefill_workers(g: DisaggGraph) -> dict[int, int]:
    """worker_index -> pid of the registered prefill workers."""
    out = g.etcdctl("get", "--prefix", "/dynamo/instances/PrefillWorker/", "--print-value-only")
    recs = [json.loads(line) for line in out.strip().splitlines() if line]
    return {int(r["worker_index"]): int(r["pid"]) for r in recs}


async def test_a_killed_prefill_workers_job_is_redelivered_and_its_kv_used(
    disagg_graph: DisaggGraph, agg_reference: dict[str, Greedy]
) -> None:
    """The prefill worker holding a job dies: the job goes to the other prefill worker
    after ack-wait, and the decode worker, still waiting, pulls that worker's KV."""
    g = disagg_graph
    workers = prefill_workers(g)
    assert len(workers) == 2, workers
    # one connection with the graph's own settings (connecting updates the shared consumer)
    q = NatsPrefillQueue(g.nats_url, "dynamo", ack_wait=ACK_WAIT, max_deliver=3)
    await q.connect()
    try:
        await _kill_while_holding(g, q, workers, agg_reference)
    finally:
        await q.close()


async def _kill_while_holding(g: DisaggGraph, q: NatsPrefillQueue, workers: dict[int, int],
                              agg_reference: dict[str, Greedy]) -> None:
    g.etcdctl("put", HOLD, "60")
    result: dict[str, object] = {}
    before = g.metrics()

    def send() -> None:
        result["body"] = complete(g.url, KILL_PROMPT.text)

    thread = threading.Thread(target=send, daemon=True)
    try:
        thread.start()
        line = g.proc.wait_for_line("(fault injection)", timeout=30)
        m = re.match(r"\[PrefillWorker:(\d+)\]", line)
        assert m is not None, line
        victim = workers[int(m.group(1))]
        assert await queue_stats(q) == (0, 1)  # the worker holds the job, unacked
    finally:
        g.etcdctl("del", HOLD)  # the other worker must not hold the redelivery
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the request did not complete"
    body = result["body"]
    assert isinstance(body, dict) and prompt_tokens(body) > THRESHOLD
    assert_agrees(agg_reference[KILL_PROMPT.text], text_of(body))
    deadline = time.monotonic() + 10
    while True:  # the redelivered job's KV was used: remote, over NIXL, nothing computed
        moved = {k: delta(before, g.metrics(), k) for k in (REMOTE, TIMEOUT_FALLBACK, EXTERNAL)}
        if moved[REMOTE] >= 1 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert moved[REMOTE] == 1 and moved[TIMEOUT_FALLBACK] == 0 and moved[EXTERNAL] > 0, moved
    deadline = time.monotonic() + 120
    while (stats := await queue_stats(q)) != (0, 0):
        assert time.monotonic() < deadline, (
            f"job still queued: waiting/in-flight {stats}\n" + "\n".join(g.proc.lines[-80:]))
        await asyncio.sleep(0.5)
    while victim in (pids := set(prefill_workers(g).values())) or len(pids) < 2:
        assert time.monotonic() < deadline, (
            f"prefill worker not back: {pids}\n" + "\n".join(g.proc.lines[-80:]))
        await asyncio.sleep(0.5)


def test_every_remote_kv_was_read_within_its_lease(disagg_graph: DisaggGraph) -> None:
    """The prefill engine frees a request's KV when its lease (vLLM: 30 s) ends unread; a
    decode worker reading later gets blocks that may already hold other data. (Served with
    vLLM's engine-core processes, every remote prefill once waited out that lease.)"""
    expired = [line for line in disagg_graph.proc.lines
               if "Releasing expired KV blocks" in line or "Potentially invalid KV blocks" in line]
    assert expired == []


def test_the_nixl_engines_kv_caches_are_in_huge_pages(disagg_graph: DisaggGraph) -> None:
    """``huge-pages`` unset and ``kv-transport: nixl``: each engine's 1 GiB KV cache is in
    transparent huge pages, where the kernel allows them (a NIXL read copies from them
    about twice as fast as from 4 KiB pages)."""
    engines, _ = split_processes(disagg_graph.proc.proc.pid)
    assert len(engines) >= 3, engines  # a decode engine, two prefill engines
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp_off = "[never]" in f.read()
    for pid in engines:
        huge = anon_huge_kib(pid)
        assert thp_off or huge >= 256 * 1024, f"engine {pid}: {huge} KiB in huge pages"
