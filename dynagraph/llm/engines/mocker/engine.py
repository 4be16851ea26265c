"""``MockerEngine``: the simulated scheduler run in wall-clock time behind the Engine protocol.

One asyncio task per engine runs steps: :meth:`Scheduler.step` (microseconds of
Python), then it waits out the profile's price of the step divided by ``speed``
(counted from the step's start, so the Python time is inside it; a step that follows
another starts when that one was due to end, so timer lateness does not accumulate),
then it delivers the step's tokens and KV events. Requests arriving meanwhile join the next step, as in
vLLM. An idle engine awaits an ``asyncio.Event`` and costs nothing; timers (a remote
KV transfer finishing, a prefill lease expiring) are loop callbacks that wake it.

The engine's state and step pricing are an ``EngineCore`` (``core.py``; no clock), which
``dynagraph.simulate`` drives on a virtual clock instead.

Everything that changes the scheduler from outside the step task (aborts, finished
transfers, released leases) is queued and applied by that task between steps, so a
step never sees its state change under it. Many engines can share one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from dynagraph.errors import EngineError, InvalidRequest
from dynagraph.llm.engines.base import EngineLoad, EngineOutput, SamplingSpec
from dynagraph.llm.router.events import KvEvent

from .args import MockerEngineArgs
from .core import EngineCore, StepStats
from .outputs import OutputStream
from .profile import Profile
from .scheduler import Delta, RemoteLoad
from .transfer import KvTransferRegistry, process_registry, transfer_seconds

log = logging.getLogger(__name__)

__all__ = ["MAX_CATCH_UP_S", "MockerEngine", "StepStats"]

KvEventsCallback = Callable[[list[KvEvent]], None]
SHUTDOWN_TIMEOUT_S = 5.0
MAX_CATCH_UP_S = 0.05
"""A step that starts at most this late after the previous one's end is timed from that
end (see ``_loop``); later than that (an idle gap, a stalled process), from now."""


class MockerEngine:
    """A simulated vLLM engine. See the package docstring for how it maps to vLLM.

    ``on_kv_events`` (optional) is called on the event loop with each step's KV events
    (a list, in order), right after that step's tokens are delivered, and with the
    events of changes between steps when the engine goes idle; without it no events are
    made. ``registry`` is where prefill engines of this process find each other for
    simulated KV hand-offs (default :func:`process_registry`). ``profile`` overrides
    ``args.profile`` (tests). Call :meth:`start` inside the event loop that will serve.
    """

    def __init__(
        self,
        args: MockerEngineArgs,
        *,
        on_kv_events: KvEventsCallback | None = None,
        registry: KvTransferRegistry | None = None,
        profile: Profile | None = None,
    ) -> None:
        self.args = args
        self.core = EngineCore(args, engine_id=args.engine_id or f"mocker-{secrets.token_hex(4)}",
                               emit_events=on_kv_events is not None, profile=profile)
        core = self.core
        self.profile = core.profile
        self.block_size = core.block_size
        self.num_blocks = core.num_blocks
        self.engine_id = core.engine_id
        self.max_model_len = core.max_model_len
        self.hasher = core.hasher
        self.scheduler = core.scheduler
        self.stats = core.stats
        self.on_kv_events = on_kv_events
        self.registry = registry if registry is not None else process_registry()
        self._streams: dict[str, OutputStream] = {}
        self._ops: deque[Callable[[], object]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._loads: dict[str, RemoteLoad] = {}
        self._link_free_at = 0.0
        self._transfer_listener: Callable[[int, float], None] | None = None
        self._failed: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        if self._task is not None:
            return
        self.registry.register(self.engine_id, self)
        self._task = asyncio.create_task(self._run(), name=f"mocker-{self.engine_id}")
        log.debug("mocker %s: %d blocks of %d tokens, profile %s, speed %g", self.engine_id,
                  self.num_blocks, self.block_size, self.profile.name, self.args.speed)

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, SHUTDOWN_TIMEOUT_S)
        for handle in (*self._timers.values(), *self._leases.values()):
            handle.cancel()
        self._timers.clear()
        self._leases.clear()
        for rid in list(self._streams):
            delta = self.scheduler.abort(rid)
            if delta is not None:
                self._push(delta)
        self.registry.unregister(self.engine_id, self)

    # -- the Engine protocol --------------------------------------------------------------

    def load(self) -> EngineLoad:
        """The scheduler's state and the step counters (simulated seconds, as the Router
        should learn them), with the profile's nominal speeds as the Router's priors."""
        return self.core.load()

    async def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._submit(lambda: self._abort(request_id))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncGenerator[EngineOutput, None]:
        stream = self._admit(request_id, prompt_token_ids, sampling, kv_transfer_params)
        finished = False
        try:
            while True:
                out = await stream.get()
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._task is not None:
                self._submit(lambda: self._abort(request_id))

    def observe_kv_transfers(self, listener: Callable[[int, float], None] | None) -> None:
        """Call ``listener(bytes, seconds)`` for each simulated KV transfer into this engine."""
        self._transfer_listener = listener

    def release_transfer(self, request_id: str) -> bool:
        """A decode peer fetched ``request_id``'s KV: free the blocks held for it."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        lease.cancel()
        self._submit(lambda: self._release(request_id))
        return True

    # -- admission ------------------------------------------------------------------------

    def _admit(self, request_id: str, prompt: list[int], sampling: SamplingSpec,
               kv_transfer_params: dict[str, Any] | None) -> OutputStream:
        if self._task is None:
            raise EngineError("the mocker engine is not started (call start() first)")
        if self._failed is not None:
            raise EngineError(f"the mocker engine {self.engine_id} failed: {self._failed}")
        seq = self.core.sequence(request_id, prompt, sampling, kv_transfer_params)
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        self.core.admit(seq)
        stream = self._streams[request_id] = OutputStream()
        self._wake.set()
        return stream

    # -- the step task --------------------------------------------------------------------

    def _submit(self, op: Callable[[], object]) -> None:
        self._ops.append(op)
        self._wake.set()

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: fail every request rather than hang them
            log.exception("mocker engine %s failed", self.engine_id)
            self._failed = exc
            for stream in self._streams.values():
                stream.fail(EngineError(f"the mocker engine failed: {exc}"))

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        stats = self.stats
        core = self.core
        ops = self._ops
        deadline = -math.inf  # when the previous step ended on the simulated timeline
        while True:
            while ops:
                ops.popleft()()
            if not sched.has_work:
                self._emit(sched.take_events())
                self._wake.clear()
                await self._wake.wait()
                deadline = -math.inf  # after idling, the next step starts on arrival
                continue
            now = loop.time()
            # Back to back, a step starts when the previous one was due to end, not when
            # the loop got round to it (timers fire up to ~1 ms late): late wake-ups then
            # do not add up, and the mean step time stays the profile's.
            began = deadline if now - deadline <= MAX_CATCH_UP_S else now
            t0 = time.perf_counter()
            result, duration = core.step()
            for load in result.loads:
                self._start_load(load, began)
            if not result.scheduled:  # blocked (no blocks, no budget): wait for a change
                self._emit(result.events)
                stats.python_seconds += time.perf_counter() - t0
                self._wake.clear()
                if not ops:
                    await self._wake.wait()
                    deadline = -math.inf
                continue
            stats.python_seconds += time.perf_counter() - t0
            deadline = began + duration
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            t1 = time.perf_counter()
            for delta in result.outputs:
                self._push(delta)
            self._emit(result.events)
            stats.python_seconds += time.perf_counter() - t1

    def _push(self, delta: Delta) -> None:
        if delta.kv_transfer_params is not None:
            self._hold(delta.request_id)
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return
        if delta.finish_reason is None:
            out = EngineOutput(token_ids=delta.token_ids, num_prompt_tokens=delta.num_prompt_tokens,
                               num_cached_tokens=delta.num_cached_tokens)
        else:
            out = EngineOutput(
                token_ids=delta.token_ids, finish_reason=delta.finish_reason,
                num_prompt_tokens=delta.num_prompt_tokens,
                num_cached_tokens=delta.num_cached_tokens,
                kv_transfer_params=delta.kv_transfer_params,
            )
        stream.push(out)

    def _emit(self, events: list[KvEvent]) -> None:
        if events and self.on_kv_events is not None:
            try:
                self.on_kv_events(events)
            except Exception:
                log.exception("on_kv_events callback of %s failed", self.engine_id)

    def _abort(self, request_id: str) -> None:
        delta = self.scheduler.abort(request_id)
        load = self._loads.pop(request_id, None)
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        if load is not None:  # the producer holds blocks for a transfer that will not come
            self.registry.fetched(str(load.params.get("remote_engine_id")),
                                  str(load.params.get("remote_request_id")))
        if delta is not None:
            self._push(delta)

    def _release(self, request_id: str) -> None:
        self.scheduler.release(request_id)

    # -- simulated KV transfers -----------------------------------------------------------

    def _hold(self, request_id: str) -> None:
        """A prefill for a remote decode finished: hold its blocks until fetched or the lease."""
        loop = asyncio.get_running_loop()
        self._leases[request_id] = loop.call_later(
            self.args.kv_lease_seconds / self.args.speed, self._lease_expired, request_id)

    def _lease_expired(self, request_id: str) -> None:
        if self._leases.pop(request_id, None) is not None:
            log.debug("mocker %s: lease of %s expired", self.engine_id, request_id)
            self._submit(lambda: self._release(request_id))

    def _start_load(self, load: RemoteLoad, now: float) -> None:
        a = self.args
        nbytes = self.profile.transfer_bytes(load.num_tokens)
        seconds = transfer_seconds(nbytes, a.kv_transfer_bandwidth_gbps,
                                   a.kv_transfer_latency_s) / a.speed
        start = max(now, self._link_free_at)
        self._link_free_at = done = start + seconds
        self._loads[load.request_id] = load
        loop = asyncio.get_running_loop()
        self._timers[load.request_id] = loop.call_at(done, self._load_done, load, nbytes,
                                                     done - now)

    def _load_done(self, load: RemoteLoad, nbytes: int, seconds: float) -> None:
        self._timers.pop(load.request_id, None)
        if self._loads.pop(load.request_id, None) is None:
            return
        if self._transfer_listener is not None:
            self._transfer_listener(nbytes, seconds)
        self.registry.fetched(str(load.params.get("remote_engine_id")),
                              str(load.params.get("remote_request_id")))
        self._submit(lambda: self.scheduler.finish_remote_load(load.request_id))
