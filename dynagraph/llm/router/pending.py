"""The Router's forecast of one worker's prefill queue. Pure: the caller passes the time.

A worker reports its load ten times a second, and a report is tens of milliseconds old
when it arrives; requests arrive faster than that. So the Router also keeps its own
account of the requests it sent each worker (:class:`WorkerQueue`): each tracked request
joins the queue with the prompt tokens the worker must compute for it (predicted from
the prefix index), and the worker is assumed to work through them first come, first
served (vLLM's scheduler does), at its learned speed. A request whose tokens are all
computed is *decoding* until the caller ends it; ending a request also removes whatever
the forecast still had queued for it.

Each report corrects the forecast by counting, not by timing: the worker says how many
requests it has received (``requests_total``) and how many of them still wait for their
first token (``prefilling``). The first tells which of this Router's requests the report
has seen (the n-th request routed here is seen once the worker has received n of this
Router's requests; requests from elsewhere are counted out as the excess over what was
routed). Of the seen ones, first come first served, the newest ``prefilling`` are still
in prefill and the older ones are done, whatever the forecast's clock says: a worker
slower than its learned speed keeps its queue, a faster one loses it. A request found
still in prefill that the forecast had finished is put back: the oldest such request,
which the worker is computing now, with half its tokens, the others with all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Job:
    seq: int
    """This request's place among those routed to the worker (0, 1, ...)."""
    tokens: float
    """Prompt tokens the worker must compute for it."""
    remaining: float
    """Prompt tokens still to compute, as forecast; 0 once decoding."""
    at: float = 0.0
    """When it was routed."""


class WorkerQueue:
    """Requests this Router sent one worker, in the order sent: in prefill or decoding.

    Times are seconds on one monotonic clock, supplied by the caller. Keys are the
    caller's ids for its requests.
    """

    __slots__ = ("_foreign", "_jobs", "_now", "_routed")

    def __init__(self) -> None:
        self._jobs: dict[int, _Job] = {}  # insertion order = routing order
        self._now: float | None = None
        self._routed = 0
        self._foreign: int | None = None
        """Requests the worker received from elsewhere (None: no report yet)."""

    @property
    def idle(self) -> bool:
        """No request of this Router's on the worker: nothing queued, nothing decoding
        (advancing an idle queue changes nothing: idle time is not banked)."""
        return not self._jobs

    @property
    def queued_tokens(self) -> float:
        """Prompt tokens forecast to be computed before a request arriving now starts."""
        return sum(j.remaining for j in self._jobs.values())

    @property
    def prefilling(self) -> int:
        return sum(1 for j in self._jobs.values() if j.remaining > 0)

    @property
    def decoding(self) -> int:
        return sum(1 for j in self._jobs.values() if j.remaining <= 0)

    def advance(self, now: float, s_per_token: float) -> None:
        """Let the worker compute prompt tokens, oldest request first, until ``now``.

        Time the forecast has no request for is not banked: a worker idle for a
        second does not owe a second of work to the next request.
        """
        last, self._now = self._now, now
        if last is None or now <= last or s_per_token <= 0:
            return
        budget = (now - last) / s_per_token
        for job in self._jobs.values():
            if job.remaining <= 0:
                continue
            if job.remaining > budget:
                job.remaining -= budget
                return
            budget -= job.remaining
            job.remaining = 0.0

    def add(self, key: int, tokens: float, now: float) -> None:
        """A request routed here at ``now`` that must compute ``tokens`` prompt tokens."""
        if self._now is None or now > self._now:
            self._now = now
        self.finish(key)
        t = max(float(tokens), 0.0)
        self._jobs[key] = _Job(seq=self._routed, tokens=t, remaining=t, at=now)
        self._routed += 1

    def finish(self, key: int) -> float | None:
        """The request ended (or was cancelled): it is neither queued nor decoding.
        Returns when it was routed (None: not in the queue)."""
        job = self._jobs.pop(key, None)
        return job.at if job is not None else None

    @property
    def size(self) -> int:
        """This Router's requests on the worker (queued, in prefill or decoding)."""
        return len(self._jobs)

    def reconcile(self, requests_total: int, prefilling: int) -> None:
        """Correct the forecast with a report: the worker has received ``requests_total``
        requests since it started, ``prefilling`` of which wait for their first token."""
        if requests_total <= 0:
            return  # a worker that does not count its requests
        if self._foreign is None:
            # Received before this Router's first request reached it: not ours.
            self._foreign = max(requests_total - self._routed, 0)
        self._foreign = max(self._foreign, requests_total - self._routed)
        seen = requests_total - self._foreign
        visible = [j for j in self._jobs.values() if j.seq < seen]
        in_prefill = min(max(prefilling, 0), len(visible))
        done = len(visible) - in_prefill
        for i, job in enumerate(visible):
            if i < done:
                job.remaining = 0.0
            elif job.remaining <= 0:
                job.remaining = job.tokens / 2 if i == done else job.tokens
