"""The simulation on small synthetic traces: routing, cache hits, rejections, the summary."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dynagraph.llm.engines.mocker import MockerEngineArgs, StepWork, load_profile
from dynagraph.llm.router.config import RouterConfig
from dynagraph.simulate.fleet import SimResult, Simulation
from dynagraph.simulate.plan import SimPlan
from dynagraph.simulate.report import request_line, summarize
from dynagraph.simulate.trace import TraceRequest

PROFILE = load_profile("h200-llama8b-bf16")
TRACE_BS = 64


def plan(mode: str = "kv", engines: int = 4, max_model_len: int = 2048,
         router: RouterConfig | None = None, **kw: Any) -> SimPlan:
    args = MockerEngineArgs.model_validate({
        "profile": "h200-llama8b-bf16", "block-size": 16, "num-gpu-blocks": 1024,
        "max-model-len": max_model_len, "max-num-batched-tokens": 512, **kw})
    return SimPlan(engine_args=args, profile=PROFILE, engines=engines, mode=mode,
                   max_model_len=max_model_len,
                   router=router if router is not None else RouterConfig(block_size=16))


def conversations(n: int = 6, turns: int = 4, gap_s: float = 2.0) -> list[TraceRequest]:
    """``n`` conversations of ``turns`` turns; each turn repeats the previous turn's
    blocks and adds three more; a turn comes ``gap_s`` after the previous one."""
    out: list[TraceRequest] = []
    next_id = 0
    history: list[list[int]] = [[] for _ in range(n)]
    for t in range(turns):
        for c in range(n):
            history[c] += range(next_id, next_id + 3)
            next_id += 3
            ids = tuple(history[c])
            out.append(TraceRequest(len(out), t * gap_s + c * 0.05, len(ids) * TRACE_BS - 10,
                                    20, ids))
    return out


def run(p: SimPlan, reqs: list[TraceRequest], seed: int = 0) -> SimResult:
    return Simulation(p, reqs, trace_block_size=TRACE_BS, seed=seed, env={}).run()


def test_kv_routing_finds_the_shared_prefixes_round_robin_mostly_misses() -> None:
    reqs = conversations()
    kv = summarize(run(plan("kv"), reqs))
    rr = summarize(run(plan("round-robin"), reqs))
    assert kv["completed"] == rr["completed"] == len(reqs)
    # every later turn can reuse its previous turn's prompt (less the partial last block)
    assert kv["cached_prompt_tokens"] >= 0.9 * sum(
        (len(r.hash_ids) - 3) * TRACE_BS for r in reqs)
    assert rr["cached_prompt_tokens"] < 0.5 * kv["cached_prompt_tokens"]
    assert kv["ttft_ms"]["mean"] < rr["ttft_ms"]["mean"]


def test_requests_that_do_not_fit_the_context_are_rejected_and_counted() -> None:
    reqs = [TraceRequest(0, 0.0, 1000, 10, tuple(range(16))),
            TraceRequest(1, 0.1, 2000, 100, tuple(range(16, 48))),
            TraceRequest(2, 0.2, 2040, 8, tuple(range(48, 80)))]
    result = run(plan(max_model_len=2048), reqs)
    s = summarize(result)
    assert (s["requests"], s["completed"], s["rejected"], s["unfinished"]) == (3, 2, 1, 0)
    bad = request_line(result.records[1])
    assert bad["worker"] is None and bad["ttft_ms"] is None
    assert "exceed the context of 2048" in bad["rejected"]
    assert s["prompt_tokens"] == 1000 + 2040


def test_summary_fields_are_present_and_consistent() -> None:
    reqs = conversations(n=4, turns=3)
    result = run(plan(), reqs)
    s = summarize(result, slo_ttft_ms=1e9, slo_itl_ms=1e9)
    for key in ("requests", "completed", "rejected", "ttft_ms", "itl_ms", "prompt_tokens",
                "cached_prompt_tokens", "goodput_rps", "worker_seconds", "wall_s", "cpu_s"):
        assert key in s
    for dist in (s["ttft_ms"], s["itl_ms"]):
        assert set(dist) == {"mean", "p50", "p90", "p99", "max"}
        assert dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
    assert s["requests"] == s["completed"] + s["rejected"] + s["unfinished"]
    assert 0 < s["cached_prompt_tokens"] <= s["prompt_tokens"]
    assert s["goodput_rps"] == s["throughput_rps"] == pytest.approx(
        s["completed"] / s["simulated_s"], rel=1e-5)
    assert s["worker_seconds"] == pytest.approx(s["workers"] * s["simulated_s"], rel=1e-6)
    assert s["simulated_s"] >= max(r.arrival_s for r in reqs)
    assert summarize(result, slo_ttft_ms=0.0)["goodput_rps"] == 0
    lines = [request_line(r) for r in result.records]
    assert sum(ln["cached_tokens"] for ln in lines) == s["cached_prompt_tokens"]
    assert all(ln["end_s"] >= ln["arrival_s"] + ln["ttft_ms"] / 1000 - 1e-9 for ln in lines)


def test_same_inputs_same_summary() -> None:
    reqs = conversations()
    p = plan("kv", router=RouterConfig(block_size=16, temperature=0.5))  # draws from the RNG

    def numbers(s: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in s.items() if k not in ("wall_s", "cpu_s")}

    a, b = run(p, reqs), run(p, reqs)
    assert numbers(summarize(a)) == numbers(summarize(b))
    assert [request_line(r) for r in a.records] == [request_line(r) for r in b.records]
    other = run(p, reqs, seed=1)
    assert [r.worker for r in other.records] != [r.worker for r in a.records]


def test_one_request_takes_the_profiles_step_times() -> None:
    """1000 prompt tokens in chunks of 512 (one step each), then one decode step a token."""
    result = run(plan(engines=1), [TraceRequest(0, 1.5, 1000, 3, tuple(range(16)))])
    rec = result.records[0]
    prefill = (PROFILE.step_seconds(StepWork(512, 0)) +
               PROFILE.step_seconds(StepWork(488, 488 * 512)))
    assert rec.ttft_s == pytest.approx(prefill)
    decode = (PROFILE.step_seconds(StepWork(decode_seqs=1, decode_context=1001)) +
              PROFILE.step_seconds(StepWork(decode_seqs=1, decode_context=1002)))
    assert rec.end_s == pytest.approx(1.5 + prefill + decode)
    assert result.span_s == rec.end_s


@pytest.mark.parametrize(("timeout_s", "served", "by"), [
    (30.0, [0, 1, 2], {"queue-full": 2}),
    (0.001, [0, 1], {"queue-full": 2, "queue-timeout": 1}),
])
def test_the_frontends_slots_queue_and_refuse(timeout_s: float, served: list[int],
                                              by: dict[str, int]) -> None:
    p = dataclasses.replace(plan(), max_inflight=2, max_queued=1, queue_timeout_s=timeout_s)
    reqs = [TraceRequest(i, 0.0, 1000, 5, tuple(range(16 * i, 16 * i + 16))) for i in range(5)]
    result = run(p, reqs)
    s = summarize(result)
    assert [r.index for r in result.records if r.completed] == served
    assert s["rejected_by"] == by and s["unfinished"] == 0
    if timeout_s > 1:  # the queued request waited for the first slot that freed
        first_end = min(r.end_s for r in result.records[:2] if r.end_s is not None)
        assert result.records[2].first_token_s is not None
        assert result.records[2].first_token_s > first_end
