"""The Router's forecast of a worker's prefill queue: exact token counts."""

from __future__ import annotations

from dynagraph.llm.router.pending import WorkerQueue

P = 1 / 1000  # seconds per token: 1000 tokens per second


def test_jobs_drain_first_come_first_served_at_the_learned_speed() -> None:
    q = WorkerQueue()
    q.add(1, 3000, now=10.0)
    q.add(2, 500, now=10.0)
    assert (q.queued_tokens, q.prefilling, q.decoding) == (3500, 2, 0)
    q.advance(11.0, P)  # 1000 tokens of job 1
    assert (q.queued_tokens, q.prefilling) == (2500, 2)
    q.advance(13.25, P)  # 2000 of job 1, then 250 of job 2
    assert (q.queued_tokens, q.prefilling, q.decoding) == (250, 1, 1)
    q.advance(13.0, P)  # time never goes back
    assert q.queued_tokens == 250
    q.advance(20.0, P)
    assert (q.queued_tokens, q.prefilling, q.decoding) == (0, 0, 2)


def test_idle_time_is_not_banked() -> None:
    q = WorkerQueue()
    q.add(1, 100, now=0.0)
    q.advance(5.0, P)
    q.add(2, 2000, now=5.0)
    q.advance(6.0, P)
    assert q.queued_tokens == 1000


def test_finishing_removes_a_request_wherever_it_is() -> None:
    q = WorkerQueue()
    q.add(1, 100, now=0.0)
    q.add(2, 100, now=0.0)
    q.advance(0.1, P)
    q.finish(1)  # decoding -> gone
    q.finish(2)  # queued -> gone
    q.finish(3)  # unknown: ignored
    assert (q.queued_tokens, q.prefilling, q.decoding) == (0, 0, 0)
    q.add(4, 50, now=1.0)
    q.add(4, 70, now=1.0)  # the same key again replaces it
    assert (q.queued_tokens, q.prefilling) == (70, 1)


def test_reports_count_which_requests_are_done() -> None:
    q = WorkerQueue()
    q.reconcile(requests_total=5, prefilling=0)  # 5 requests before ours: not ours
    for key in (1, 2, 3):
        q.add(key, 1000, now=0.0)
    # the worker has seen two of ours (7 = 5 + 2) and one waits for its first token:
    # first come first served, ours #1 is done, #2 is not, #3 is unseen
    q.reconcile(requests_total=7, prefilling=1)
    assert (q.queued_tokens, q.prefilling, q.decoding) == (2000, 2, 1)
    # a faster worker than forecast: all three done although no time has passed
    q.reconcile(requests_total=8, prefilling=0)
    assert (q.queued_tokens, q.decoding) == (0, 3)


def test_a_slower_worker_keeps_its_queue() -> None:
    q = WorkerQueue()
    q.reconcile(requests_total=1, prefilling=0)
    for key in (1, 2, 3):
        q.add(key, 1000, now=0.0)
    q.advance(10.0, P)  # the forecast thinks all three are done
    assert q.queued_tokens == 0
    # the worker says two still wait: #2 is being computed (half put back), #3 whole
    q.reconcile(requests_total=4, prefilling=2)
    assert (q.queued_tokens, q.prefilling, q.decoding) == (1500, 2, 1)
    # requests from elsewhere are not taken for ours
    q.reconcile(requests_total=10, prefilling=2)
    assert q.queued_tokens == 1500
    q.add(4, 400, now=10.0)  # unseen until the worker has received 4 of ours
    q.reconcile(requests_total=10, prefilling=0)
    assert (q.queued_tokens, q.prefilling) == (400, 1)
    q.reconcile(requests_total=0, prefilling=0)  # a worker that does not count: ignored
    assert q.queued_tokens == 400
