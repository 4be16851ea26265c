"""Scheduler: continuous batching, chunked prefill, prefix hits, preemption, remote prefill."""

from __future__ import annotations

from typing import Any

import pytest

from dynagraph.errors import InvalidRequest
from dynagraph.llm.engines.mocker.profile import StepWork
from dynagraph.llm.engines.mocker.scheduler import RemoteLoad, Scheduler, SchedulerConfig
from dynagraph.llm.engines.mocker.sequence import Sequence, Status, TokenSource
from dynagraph.llm.router.events import BlocksRemoved, BlocksStored
from dynagraph.llm.router.hashing import BlockHasher

BS = 4
HASHER = BlockHasher(BS)


def seq(rid: str, prompt: list[int], max_tokens: int = 3, **kw: Any) -> Sequence:
    return Sequence(rid, prompt, max_tokens=max_tokens, hasher=HASHER,
                    tokens=TokenSource(hash(rid) & 0xFFFF, 1000), **kw)


def sched(num_blocks: int = 64, **kw: Any) -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=num_blocks, block_size=BS, **kw))


def prompt(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def test_one_request_prefill_then_decode_then_length() -> None:
    s = sched()
    a = seq("a", prompt(10))
    s.add(a)
    r1 = s.step()
    assert r1.scheduled == {"a": 10}
    assert r1.work == StepWork(prefill_tokens=10)
    assert [(d.request_id, len(d.token_ids), d.finish_reason) for d in r1.outputs] == [
        ("a", 1, None)]
    assert r1.outputs[0].num_prompt_tokens == 10 and r1.outputs[0].num_cached_tokens == 0
    r2 = s.step()
    assert r2.work == StepWork(decode_seqs=1, decode_context=11)
    r3 = s.step()
    assert r3.work == StepWork(decode_seqs=1, decode_context=12)
    assert r3.finished == ["a"]
    assert r3.outputs[0].finish_reason == "length"
    assert a.num_output_tokens == 3 and a.status is Status.FINISHED
    assert not s.has_work and s.kv.num_used_blocks == 0 and "a" not in s.requests
    # blocks full within the 12 computed tokens were stored: after step 1 (8 tokens:
    # 2 blocks) and step 3 (12 tokens: the third, holding the first two outputs)
    stored = [e for r in (r1, r2, r3) for e in r.events]
    assert stored == [
        BlocksStored(block_hashes=a.block_hashes[:2], parent_hash=None, block_size=BS),
        BlocksStored(block_hashes=[a.block_hashes[2]], parent_hash=a.block_hashes[1],
                     block_size=BS),
    ]
    assert a.block_hashes == HASHER.block_hashes(a.token_ids)


def test_chunked_prefill_follows_the_token_budget() -> None:
    s = sched(max_num_batched_tokens=4)
    s.add(seq("a", prompt(10)))
    works, outs = [], []
    for _ in range(3):
        r = s.step()
        works.append(r.work)
        outs.append(len(r.outputs))
    assert works == [StepWork(4, 0), StepWork(4, 16), StepWork(2, 16)]  # 2 new on 8 cached
    assert outs == [0, 0, 1]  # only the chunk reaching the end samples a token


def test_decodes_go_first_and_a_new_prompt_takes_the_rest_of_the_budget() -> None:
    s = sched(max_num_batched_tokens=8)
    s.add(seq("a", prompt(5), max_tokens=10))
    s.step()
    s.add(seq("b", prompt(20, 500)))
    r = s.step()
    assert r.scheduled == {"a": 1, "b": 7}
    assert r.work == StepWork(prefill_tokens=7, decode_seqs=1, decode_context=6)


def test_prefix_hit_cuts_the_prefill_and_is_counted() -> None:
    s = sched()
    s.add(seq("a", prompt(10), max_tokens=1))
    s.step()
    b = seq("b", prompt(10), max_tokens=1)
    s.add(b)
    r = s.step()
    assert r.scheduled == {"b": 2}
    assert r.work == StepWork(prefill_tokens=2, prefill_weighted_cached=16)
    assert r.outputs[0].num_cached_tokens == 8
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (20, 8)


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    s = sched()
    s.add(seq("a", prompt(8), max_tokens=1))
    s.step()
    s.add(seq("b", prompt(8), max_tokens=1))
    r = s.step()
    assert r.scheduled == {"b": 4}  # hit limited to 7 tokens: one block
    assert r.outputs[0].num_cached_tokens == 4


def test_max_num_seqs_keeps_the_rest_waiting() -> None:
    s = sched(max_num_seqs=2)
    for rid in "abc":
        s.add(seq(rid, prompt(3, ord(rid) * 10)))
    r = s.step()
    assert list(r.scheduled) == ["a", "b"]
    assert (s.num_running, s.num_waiting) == (2, 1)


def test_fcfs_a_waiting_request_that_does_not_fit_blocks_those_behind_it() -> None:
    s = sched(num_blocks=5)  # 4 usable blocks
    s.add(seq("big", prompt(12), max_tokens=4))  # 3 blocks
    s.step()
    s.add(seq("b", prompt(8, 300)))  # needs 2 more: only 1 free
    s.add(seq("c", prompt(2, 400)))  # would fit, but FCFS
    r = s.step()
    assert r.scheduled == {"big": 1}
    assert [q.request_id for q in s.waiting] == ["b", "c"]


def test_preemption_frees_the_last_running_request_and_recomputes_it_later() -> None:
    s = sched(num_blocks=5)  # 4 usable blocks
    a, b = seq("a", prompt(7), max_tokens=3), seq("b", prompt(7, 300), max_tokens=3)
    s.add(a)
    s.add(b)
    s.step()  # both prefill: 2 blocks each, pool full
    s.step()  # both decode their 8th token: still 2 blocks each
    r = s.step()  # a needs a 3rd block: b is preempted
    assert r.preempted == ["b"]
    assert r.scheduled == {"a": 1}
    assert b.status is Status.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.num_output_tokens == 2
    assert [q.request_id for q in s.waiting] == ["b"]
    # b's second block (cached, evicted for a) is reported removed
    assert BlocksRemoved(block_hashes=[b.block_hashes[1]]) in r.events
    assert r.finished == ["a"]  # a reached max_tokens in the same step
    queries = s.prefix_cache_queries
    r = s.step()  # b comes back: its first block is still cached; 9 tokens known
    assert r.scheduled == {"b": 5}
    assert r.work == StepWork(prefill_tokens=5, prefill_weighted_cached=5 * 4)
    assert s.prefix_cache_queries == queries  # a preempted request's lookup is not counted
    assert r.finished == ["b"] and b.num_output_tokens == 3


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    s = sched(max_num_seqs=2, policy="priority")
    s.add(seq("b1", prompt(3, 100), priority=10))
    s.add(seq("i1", prompt(3, 200), priority=0))
    s.add(seq("b2", prompt(3, 300), priority=10))
    s.add(seq("i2", prompt(3, 400), priority=0))
    assert [q.request_id for q in s.waiting] == ["i1", "i2", "b1", "b2"]
    assert list(s.step().scheduled) == ["i1", "i2"]
    fcfs = sched(max_num_seqs=2)
    for rid, p in (("b1", 10), ("i1", 0)):
        fcfs.add(seq(rid, prompt(3, ord(rid[0]) * 10), priority=p))
    assert list(fcfs.step().scheduled) == ["b1", "i1"]  # FCFS ignores priority


def test_priority_policy_preempts_the_lowest_priority_and_gives_back_its_budget() -> None:
    s = sched(num_blocks=5, policy="priority")  # 4 usable blocks
    b, a = seq("b", prompt(7, 300), max_tokens=3, priority=10), seq("a", prompt(7), max_tokens=3)
    s.add(b)  # b arrives first but has the lower priority (higher number)
    s.add(a)
    assert list(s.step().scheduled) == ["a", "b"]  # by priority: a first
    s.step()  # both decode their 8th token: 2 blocks each, pool full
    r = s.step()  # a needs a 3rd block; FCFS would preempt the last (b) too, but here
    assert r.preempted == ["b"] and r.scheduled == {"a": 1}  # b is the lowest priority
    assert [q.request_id for q in s.waiting] == ["b"]
    # b scheduled before a in the running order: preempting it returns its tokens
    s2 = sched(num_blocks=5, policy="priority")
    lo, hi = seq("lo", prompt(5, 500), max_tokens=8, priority=10), seq("hi", prompt(7, 600),
                                                                      max_tokens=8)
    s2.add(lo)
    s2.step()  # lo alone: admitted first, so it runs ahead of hi
    s2.add(hi)
    s2.step()  # hi's prefill fills the pool
    s2.step()
    assert [q.request_id for q in s2.running] == ["lo", "hi"]
    r = s2.step()  # lo decodes its 8th token (2 blocks), then hi needs a 3rd block
    assert r.preempted == ["lo"] and r.scheduled == {"hi": 1}
    assert r.work == StepWork(decode_seqs=1, decode_context=9)
    # a request that is its own victim ends the running pass, as in vLLM
    s3 = sched(num_blocks=5, policy="priority")
    x, y = seq("x", prompt(7), max_tokens=3, priority=10), seq("y", prompt(7, 300), max_tokens=3)
    s3.add(x)
    s3.step()
    s3.add(y)
    s3.step()
    r = s3.step()  # x (lowest priority) needs a 3rd block: it is preempted, y still decodes
    assert r.preempted == ["x"]


def test_no_admission_in_a_step_that_preempted() -> None:
    s = sched(num_blocks=5)
    s.add(seq("a", prompt(7), max_tokens=5))
    s.add(seq("b", prompt(7, 300), max_tokens=5))
    s.step()
    s.step()
    s.add(seq("c", prompt(1, 900)))
    r = s.step()
    assert r.preempted == ["b"] and "c" not in r.scheduled


def test_watermark_keeps_blocks_free_for_running_requests() -> None:
    s = sched(num_blocks=11, watermark=0.2)  # 10 usable, 2 kept back from admissions
    s.add(seq("a", prompt(15), max_tokens=5))  # 4 blocks: admitted (nothing running)
    s.step()
    s.add(seq("b", prompt(15, 300)))  # 4 more + 2 kept back = the 6 free: fits exactly
    assert "b" in s.step().scheduled
    s.add(seq("c", prompt(1, 900)))  # a's 17th token takes a block: 1 free, 1 + 2 wanted
    r = s.step()
    assert "c" not in r.scheduled and [q.request_id for q in s.waiting] == ["c"]


def test_abort_anywhere_frees_blocks() -> None:
    s = sched(max_num_seqs=1)
    s.add(seq("run", prompt(6), max_tokens=10))
    s.add(seq("wait", prompt(6, 300)))
    s.step()
    assert s.kv.num_used_blocks == 2
    d = s.abort("run")
    assert d is not None and d.finish_reason == "abort" and d.token_ids == []
    assert s.kv.num_used_blocks == 0 and s.num_running == 0
    d = s.abort("wait")
    assert d is not None and d.finish_reason == "abort"
    assert s.abort("wait") is None and s.abort("never") is None
    assert not s.has_work


def test_duplicate_request_ids_are_refused() -> None:
    s = sched()
    s.add(seq("a", prompt(3)))
    with pytest.raises(InvalidRequest, match="already in flight"):
        s.add(seq("a", prompt(3)))


def test_prefill_for_a_remote_decode_holds_its_blocks_until_released() -> None:
    s = sched(engine_id="P")
    p = seq("p", prompt(10), max_tokens=1, remote_decode=True)
    s.add(p)
    r = s.step()
    (out,) = r.outputs
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    assert out.kv_transfer_params == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "P",
        "remote_request_id": "p", "remote_block_ids": [1, 2, 3],
        "remote_block_hashes": p.block_hashes[:2], "remote_num_tokens": 10,
        "remote_prefill_cached_tokens": 0, "transfer_mode": "mocker",
    }
    assert s.kv.num_used_blocks == 3 and "p" in s.held and not s.has_work
    assert s.abort("p") is None  # finished: only a release frees it
    assert s.release("p") and s.kv.num_used_blocks == 0
    assert not s.release("p")


def test_decode_of_a_remote_prefill_waits_for_the_kv_then_computes_one_token() -> None:
    s = sched()
    s.add(seq("warm", prompt(5), max_tokens=1))  # caches the first block locally
    s.step()
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "x"}
    d = seq("d", prompt(10), max_tokens=2, remote_prefill=params)
    s.add(d)
    r = s.step()
    assert r.scheduled == {} and r.outputs == []
    assert r.loads == [RemoteLoad("d", 10 - 4, params)]  # local hit of one block
    assert d.status is Status.WAITING_FOR_REMOTE_KV
    assert s.kv.block_ids("d")[:1] == [1] and len(s.kv.block_ids("d")) == 3
    assert (s.num_running, s.num_waiting, s.has_work) == (0, 1, False)
    assert s.finish_remote_load("d")
    assert s.take_events() == [BlocksStored(block_hashes=[d.block_hashes[1]],
                                            parent_hash=d.block_hashes[0], block_size=BS)]
    r = s.step()
    assert r.scheduled == {"d": 1}
    assert r.work == StepWork(prefill_tokens=1, prefill_weighted_cached=9)
    assert r.outputs[0].num_cached_tokens == 10 and len(r.outputs[0].token_ids) == 1
    assert s.step().finished == ["d"]
    assert not s.finish_remote_load("d")


def test_abort_while_waiting_for_remote_kv() -> None:
    s = sched()
    s.add(seq("d", prompt(10), remote_prefill={"do_remote_prefill": True}))
    s.step()
    assert s.abort("d") is not None
    assert s.kv.num_used_blocks == 0 and s.num_waiting == 0
    assert not s.finish_remote_load("d")


def test_outputs_are_deterministic_and_avoid_excluded_tokens() -> None:
    def run(excluded: frozenset[int]) -> list[int]:
        s = sched()
        q = Sequence("a", prompt(5), max_tokens=50, hasher=HASHER,
                     tokens=TokenSource(1234, 6, excluded))
        s.add(q)
        while s.has_work:
            s.step()
        return q.output_token_ids

    plain = run(frozenset())
    assert plain == run(frozenset()) and len(plain) == 50
    assert set(plain) <= set(range(6))
    avoided = run(frozenset({0, 1, 2}))
    assert set(avoided) <= {3, 4, 5}
    with pytest.raises(InvalidRequest, match="every token id"):
        TokenSource(1, 3, frozenset({0, 1, 2}))


@pytest.mark.parametrize("full_isl", [True, False])
def test_admission_needs_room_for_the_whole_prompt(full_isl: bool) -> None:
    s = sched(num_blocks=7, max_num_batched_tokens=8, reserve_full_isl=full_isl)  # 6 usable
    s.add(seq("a", prompt(12), max_tokens=20))  # 3 blocks
    while s.kv.num_used_blocks < 3 or s.running[0].num_output_tokens == 0:
        s.step()
    s.add(seq("b", prompt(16, 300)))  # 4 blocks in all; its first chunk (8 tokens) needs 2
    r = s.step()
    assert ("b" in r.scheduled) is (not full_isl)


def test_token_source_finds_the_few_allowed_ids_of_a_mostly_excluded_vocabulary() -> None:
    source = TokenSource(9, 1000, frozenset(range(1000)) - {417, 8})
    assert {source.next() for _ in range(50)} == {417, 8}


def test_a_step_with_several_prefills_names_each_chunk() -> None:
    s = sched(max_num_batched_tokens=12)
    s.add(seq("a", prompt(6)))
    s.add(seq("b", prompt(9, base=300)))
    r = s.step()
    assert r.scheduled == {"a": 6, "b": 6}
    assert r.work == StepWork(prefill_tokens=12, prefill_chunks=((6, 0), (6, 0)))
