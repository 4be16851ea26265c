"""The simulation: a trace's requests through the graph's routing into simulated engines.

One process, one virtual :class:`Clock`, no sockets, no wall clock in any decision.
Events, in simulated seconds:

- **arrivals** (every request of one timestamp together): a request whose prompt plus
  output does not fit the context is *rejected* (the Processor's check); the others take
  one of the Frontend's slots, or wait for one in its FIFO queue (*rejected* when the
  queue is full, or when a slot does not come within ``queue-timeout``); with a slot, a
  request gets its prompt (``PromptBuilder``), a worker (``Routing``: the Router's
  decision and its in-flight count) and goes into that engine's waiting queue; an idle
  engine wakes. A request that ends frees its slot for the head of the queue.
- **engine steps** (``SimEngine``): a step runs when it starts and delivers its tokens
  and KV changes when it ends, its duration being the profile's price; the KV changes go
  to the Router's index; the next step starts at once while there is work. A step that
  ends before anything else is due runs without going through the clock's queue.
- **load samples** every ``load-metrics-interval``: each engine's ``EngineLoad`` when it
  changed, to the Router (``set_load``), as the workers' ``load_metrics`` streams do.

A request's first token is the end of the step that samples it; it ends with the step
that samples its last one. :meth:`Simulation.run` returns a :class:`SimResult`.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dynagraph.llm.engines.base import SamplingSpec
from dynagraph.llm.engines.mocker.core import EngineCore
from dynagraph.llm.engines.mocker.sequence import Sequence
from dynagraph.llm.router.hashing import BlockHasher

from .clock import Clock
from .engines import SimEngine
from .plan import SimPlan
from .prompts import PromptBuilder, shared_ids
from .routing import Routing
from .trace import TraceRequest

PROGRESS_EVERY_S = 2.0
"""Wall seconds between two progress reports."""
_CHECK_EVERY = 4096
"""Events between two looks at the wall clock (for progress only)."""


@dataclass(slots=True)
class RequestRecord:
    """What happened to one trace request (times in simulated seconds from the start)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    worker: int | None = None
    cached_tokens: int = 0
    first_token_s: float | None = None
    end_s: float | None = None
    rejected: str | None = None
    """Why it was refused (never admitted); None for admitted requests."""
    preemptions: int = 0

    @property
    def completed(self) -> bool:
        return self.end_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def itl_s(self) -> float | None:
        """Mean time between two output tokens (None with fewer than two)."""
        if self.end_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Progress:
    now_s: float
    """Simulated time reached."""
    last_arrival_s: float
    done: int
    total: int
    wall_s: float


@dataclass
class SimResult:
    records: list[RequestRecord]
    engines: int
    span_s: float
    """Simulated seconds from 0 to the last arrival or end, whichever is later."""
    busy_seconds: float
    """Sum over engines of simulated seconds spent in steps."""
    steps: int
    series: list[tuple[float, int, int]] = field(default_factory=list)
    """(simulated second, workers alive, workers with requests) once a second."""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    """CPU seconds of this process during the run (the wall time's honest twin on a
    shared machine)."""
    mode: str = ""


class Simulation:
    """One run of ``plan`` over ``requests`` (see the module docstring).

    ``seed`` seeds what the served graph leaves to chance (the Router's ties when its
    config sets no ``seed``, the Processor's ``random`` order); ``env`` gives the engines'
    hash seed (``PYTHONHASHSEED``; default ``os.environ``, as served). ``progress`` is
    called about every ``PROGRESS_EVERY_S`` wall seconds and at the end.
    """

    def __init__(self, plan: SimPlan, requests: list[TraceRequest], *, trace_block_size: int,
                 seed: int = 0, env: Mapping[str, str] | None = None,
                 progress: Callable[[Progress], None] | None = None) -> None:
        self.plan = plan
        self.requests = requests
        self.clock = Clock()
        self.progress = progress
        env = os.environ if env is None else env
        uses_router = plan.mode in ("kv", "kv-load")
        publish = plan.publish_kv_events and uses_router  # nobody else reads the index
        self.engines = [
            SimEngine(i, EngineCore(plan.engine_args, engine_id=f"MockerWorker-{i}",
                                    emit_events=publish, profile=plan.profile, env=env),
                      publish_kv_events=publish)
            for i in range(plan.engines)]
        hasher = self.engines[0].core.hasher
        router_bs = (plan.router.block_size if plan.router is not None
                     and plan.router.block_size is not None else hasher.block_size)
        # the served Router hashes with the workers' published settings, or with its own
        # block size (and the default seed) when its config sets one
        router_hasher = (hasher if plan.router is None or plan.router.block_size is None
                         else BlockHasher(router_bs))
        self._router_hasher = None if router_hasher == hasher else router_hasher
        self.routing = Routing(plan.mode, [e.worker_id for e in self.engines], plan.router,
                               block_size=router_bs, seed=seed)
        self.prompts = PromptBuilder(hasher, trace_block_size=trace_block_size,
                                     vocab_size=plan.engine_args.vocab_size,
                                     shared=shared_ids(requests))
        self.records = [RequestRecord(r.index, r.arrival_s, r.input_length, r.output_length)
                        for r in requests]
        self._by_index = {rec.index: rec for rec in self.records}
        self._inflight: dict[str, tuple[RequestRecord, Sequence, list[int], int | None]] = {}
        self._next = 0
        self._done = 0
        self._slots = plan.max_inflight
        self._queue: deque[tuple[TraceRequest, float]] = deque()
        self._ticking = False
        self._series: list[tuple[float, int, int]] = []
        self._last_second = -1
        self._wall0 = 0.0

    # -- the run --------------------------------------------------------------------------

    def run(self) -> SimResult:
        """Run every request to its end or rejection (once per ``Simulation``)."""
        self._wall0 = time.perf_counter()
        cpu0 = time.process_time()
        clock = self.clock
        self._ticking = True
        self._tick()  # every worker's first report, before any request
        self.routing.settle()
        if self.requests:
            clock.at(self.requests[0].arrival_s, self._arrive)
        report_at = self._wall0 + PROGRESS_EVERY_S
        events = 0
        while clock.run_next():
            events += 1
            if self.progress is not None and events % _CHECK_EVERY == 0:
                wall = time.perf_counter()
                if wall >= report_at:
                    report_at = wall + PROGRESS_EVERY_S
                    self.progress(self._progress(wall))
        wall = time.perf_counter()
        if self.progress is not None:
            self.progress(self._progress(wall))
        last = self.requests[-1].arrival_s if self.requests else 0.0
        span = max([last, *(r.end_s for r in self.records if r.end_s is not None)])
        return SimResult(
            records=self.records, engines=len(self.engines), span_s=span,
            busy_seconds=sum(e.core.stats.busy_seconds for e in self.engines),
            steps=sum(e.core.stats.steps for e in self.engines), series=self._series,
            wall_s=wall - self._wall0, cpu_s=time.process_time() - cpu0, mode=self.plan.mode)

    def _progress(self, wall: float) -> Progress:
        last = self.requests[-1].arrival_s if self.requests else 0.0
        return Progress(self.clock.now, last, self._done, len(self.requests), wall - self._wall0)

    # -- arrivals -------------------------------------------------------------------------

    def _arrive(self) -> None:
        now = self.clock.now
        requests = self.requests
        while self._next < len(requests) and requests[self._next].arrival_s <= now:
            self._admit(requests[self._next], now)
            self._next += 1
        if self._next < len(requests):
            self.clock.at(requests[self._next].arrival_s, self._arrive)
        if not self._ticking:
            self._start_ticking()

    def _admit(self, request: TraceRequest, now: float) -> None:
        """The Processor's context check (a request it refuses holds its Frontend slot for
        no time), then the Frontend's admission."""
        limit = self.plan.max_model_len
        if request.input_length + request.output_length > limit:
            self._reject(request, f"prompt {request.input_length} + output "
                         f"{request.output_length} tokens exceed the context of {limit}")
            return
        self._expire(now)
        if self._slots > 0:
            self._slots -= 1
            self._dispatch(request, now)
        elif len(self._queue) < self.plan.max_queued:
            self._queue.append((request, now + self.plan.queue_timeout_s))
        else:
            self._reject(request, "the Frontend's queue is full (429)")

    def _reject(self, request: TraceRequest, why: str) -> None:
        self._by_index[request.index].rejected = why
        self._done += 1

    def _expire(self, now: float) -> None:
        """Refuse the queued requests whose wait ran out (the oldest wait first)."""
        queue = self._queue
        while queue and queue[0][1] < now:
            self._reject(queue.popleft()[0], "no Frontend slot within queue-timeout (429)")

    def _release(self, now: float) -> None:
        """A request ended: its slot goes to the head of the queue."""
        self._expire(now)
        if self._queue:
            self._dispatch(self._queue.popleft()[0], now)
        else:
            self._slots += 1

    def _dispatch(self, request: TraceRequest, now: float) -> None:
        rec = self._by_index[request.index]
        prompt = self.prompts.prompt(request)
        rid = f"r{request.index}"
        # every engine has the same args but its id, which a Sequence does not depend on:
        # the one built by the first engine is the one the chosen engine would build
        seq = self.engines[0].core.sequence(
            rid, prompt.token_ids,
            SamplingSpec(max_tokens=request.output_length, temperature=0.0, ignore_eos=True),
            digests=prompt.digests)
        if self._router_hasher is not None:
            hashes = self._router_hasher.block_hashes(prompt.token_ids)
        else:  # the engines' hashes, as the Router computes them from the prompt
            hashes = seq.block_hashes[:]
        w, key = self.routing.choose(hashes, request.input_length, now)
        engine = self.engines[w]
        engine.admit(seq)
        rec.worker = w
        self._inflight[rid] = (rec, seq, hashes, key)
        if not engine.busy and not engine.waking:
            engine.waking = True
            self.clock.at(now, self._wake, engine)

    # -- engine steps ---------------------------------------------------------------------

    def _wake(self, engine: SimEngine) -> None:
        if engine.waking:  # else a step started meanwhile (a slot freed on this engine)
            self._step(engine)

    def _step(self, engine: SimEngine) -> None:
        """Start steps on ``engine`` from now on, for as long as each one ends before
        anything else is due; the first that does not is left on the clock."""
        clock = self.clock
        routing = self.routing
        while True:
            duration, batch = engine.start_step()
            if batch is not None:
                routing.on_kv(engine.worker_id, batch)
            if not engine.busy:
                return
            end = clock.now + duration
            if clock.next_time() <= end:
                clock.at(end, self._step_end, engine)
                return
            clock.now = end
            if not self._deliver(engine):
                return

    def _step_end(self, engine: SimEngine) -> None:
        if self._deliver(engine):
            self._step(engine)

    def _deliver(self, engine: SimEngine) -> bool:
        """The running step's outputs and KV change, now; whether the engine has work."""
        now = self.clock.now
        outputs, batch = engine.finish_step()
        inflight = self._inflight
        for delta in outputs:
            entry = inflight.get(delta.request_id)
            if entry is None:
                continue
            rec = entry[0]
            if rec.first_token_s is None:
                rec.first_token_s = now
                rec.cached_tokens = delta.num_cached_tokens
            if delta.finish_reason is not None:
                rec.end_s = now
                rec.preemptions = entry[1].num_preemptions
                del inflight[delta.request_id]
                self.routing.end(engine.worker_id, entry[2], entry[3], now)
                self._done += 1
                self._release(now)
        if batch is not None:
            self.routing.on_kv(engine.worker_id, batch)
        return engine.core.scheduler.has_work

    # -- load samples ---------------------------------------------------------------------

    def _start_ticking(self) -> None:
        interval = self.plan.load_interval_s
        self._ticking = True
        self.clock.at(math.ceil(self.clock.now / interval - 1e-9) * interval, self._tick)

    def _tick(self) -> None:
        now = self.clock.now
        routing = self.routing
        busy = 0
        for e in self.engines:
            if routing.uses_router:
                load = e.sample_load()
                if load is not None:
                    routing.on_load(e.worker_id, load, now)
            if e.core.scheduler.requests:
                busy += 1
        second = int(now)
        if second > self._last_second:
            self._last_second = second
            self._series.append((now, len(self.engines), busy))
        if (self._next < len(self.requests) or self._queue
                or any(not e.idle for e in self.engines)):
            self.clock.at(now + self.plan.load_interval_s, self._tick)
        else:
            self._ticking = False
