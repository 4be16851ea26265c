"""A vLLM-v1-like scheduler over :class:`KvBlockManager`. Pure and synchronous.

One :meth:`Scheduler.step` is one engine step, as ``vllm/v1/core/sched/scheduler.py``
schedules it, with the forward pass reduced to its bookkeeping:

1. **Running requests first**, in order: each gets ``num_tokens - num_computed_tokens``
   tokens (a prefill chunk or one decode token), capped by what is left of the token
   budget (``max_num_batched_tokens``: chunked prefill). When its blocks cannot be
   allocated, the *last* running request is preempted (recompute: its blocks are
   freed, it goes back to the front of the waiting queue with nothing computed) until
   they can, or until it is the one preempted.
2. **Then waiting requests**, in order, unless a request was preempted in this step:
   while budget, ``max_num_seqs`` and blocks allow. A request with nothing computed
   looks up its prefix in the cache (at most ``num_tokens - 1`` tokens: the last is
   always computed), which cuts its prefill; the first one that does not fit stops
   the pass (FCFS). A request is admitted only if all its known tokens fit
   (``reserve_full_isl``), keeping ``watermark`` of the blocks free when others run.
3. Allocating slots caches the blocks that this step's tokens fill (vLLM does the
   same), so ``BlocksStored`` events come out in the step that computes the blocks.
4. Every request whose computed tokens reach its known tokens gets one new token;
   one that reaches ``max_tokens`` finishes (``"length"``) and frees its blocks.

Policy ``priority`` (vLLM's ``--scheduling-policy priority``): the waiting queue is
ordered by (priority, arrival), lower first, and a preempted request goes back in its
place in that order; the preemption victim is the running request with the highest
(priority, arrival), not the last one, and if it was already scheduled in this step its
tokens go back to the budget (vLLM 0.32 does the same).

Remote prefill (vLLM's NixlConnector, simulated):

- *prefill side*: a request with ``remote_decode`` keeps its blocks when it finishes
  (``held``) and its last output carries ``kv_transfer_params`` naming this engine,
  the request, its block ids and hashes and ``remote_num_tokens``; :meth:`release`
  frees them (the decode side fetched them, or the lease ran out).
- *decode side*: a request with ``remote_prefill`` params looks up its local prefix,
  gets slots for the whole prompt, and waits in ``WAITING_FOR_REMOTE_KV`` without
  using the token budget; the step reports a :class:`RemoteLoad`. The caller times the
  transfer and calls :meth:`finish_remote_load`: the blocks are cached (stored events)
  and the request runs again from the front, computing only the last prompt token.

The step's :class:`~.profile.StepWork` says what the pass computed, for the caller to
price with a profile; nothing here knows about time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from dynagraph.errors import InvalidRequest
from dynagraph.llm.engines.base import FinishReason
from dynagraph.llm.router.events import KvEvent

from .kv import KvBlockManager
from .profile import StepWork
from .sequence import Sequence, Status


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    watermark: float = 0.0
    """Fraction of the blocks an admission must leave free while others run."""
    reserve_full_isl: bool = True
    """Admit a waiting request only if all its known tokens fit, not just the first chunk
    (vLLM's ``scheduler_reserve_full_isl``, on by default)."""
    engine_id: str = "mocker"
    emit_events: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"


@dataclass(slots=True)
class Delta:
    """What one request got in one step (the engine turns it into an ``EngineOutput``)."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RemoteLoad:
    """A decode-side request now waiting for ``num_tokens`` tokens of KV from a peer."""

    request_id: str
    num_tokens: int
    params: dict[str, Any]


@dataclass(slots=True)
class StepResult:
    work: StepWork
    scheduled: dict[str, int]
    """Tokens computed per request in this step."""
    outputs: list[Delta]
    preempted: list[str] = field(default_factory=list)
    loads: list[RemoteLoad] = field(default_factory=list)
    events: list[KvEvent] = field(default_factory=list)

    @property
    def finished(self) -> list[str]:
        return [d.request_id for d in self.outputs if d.finish_reason is not None]


class Scheduler:
    """Waiting and running queues over one block pool. See the module docstring."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KvBlockManager(
            config.num_gpu_blocks, config.block_size,
            enable_prefix_caching=config.enable_prefix_caching, emit_events=config.emit_events,
        )
        self._watermark_blocks = int(config.watermark * config.num_gpu_blocks)
        self.requests: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.ready: deque[Sequence] = deque()
        """Requests whose remote KV arrived; admitted before ``waiting`` (vLLM does too)."""
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._arrivals = 0

    # -- queries --------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything (loading and held requests do not count)."""
        return bool(self.running or self.waiting or self.ready)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.ready) + len(self.loading)

    # -- requests in and out --------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise InvalidRequest(f"request id {seq.request_id!r} is already in flight")
        self.requests[seq.request_id] = seq
        seq.arrival = self._arrivals
        self._arrivals += 1
        if self.config.policy == "priority":
            self._enqueue(seq)
        else:
            self.waiting.append(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Into ``waiting`` at its (priority, arrival) place (``priority`` policy)."""
        key = (seq.priority, seq.arrival)
        for i, other in enumerate(self.waiting):
            if (other.priority, other.arrival) > key:
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Delta | None:
        """End a request wherever it is and free its blocks. None when unknown or finished
        (a held prefill is finished: use :meth:`release`)."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status is Status.FINISHED:
            return None
        del self.requests[request_id]
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING_FOR_REMOTE_KV:
            del self.loading[request_id]
        elif seq in self.ready:
            self.ready.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(request_id)
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"
        return Delta(request_id, [], "abort", seq.num_prompt_tokens, max(seq.num_cached_tokens, 0))

    def release(self, request_id: str) -> bool:
        """Free a finished prefill's held blocks. False if it is not held."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        del self.requests[request_id]
        self.kv.free(request_id)
        return True

    def finish_remote_load(self, request_id: str) -> bool:
        """The KV of a ``WAITING_FOR_REMOTE_KV`` request arrived. False if it is gone."""
        seq = self.loading.pop(request_id, None)
        if seq is None:
            return False
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.kv.cache_blocks(request_id, seq.block_hashes, seq.num_computed_tokens)
        if seq.num_computed_tokens >= seq.num_tokens:
            seq.num_computed_tokens = seq.num_tokens - 1  # recompute the last for its logits
        seq.status = Status.WAITING
        self.ready.append(seq)
        return True

    def take_events(self) -> list[KvEvent]:
        return self.kv.take_events()

    # -- one step -------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Schedule and run one step; see the module docstring."""
        kv = self.kv
        bs = self.config.block_size
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        loads: list[RemoteLoad] = []
        running = self.running
        by_priority = self.config.policy == "priority"

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            n = min(seq.num_tokens - computed, budget)
            if n <= 0:
                i += 1
                continue
            while not kv.allocate(seq.request_id, computed + n):
                if by_priority:
                    victim = max(running, key=lambda r: (r.priority, r.arrival))
                    at = running.index(victim)
                    del running[at]
                    if at < i:
                        i -= 1
                    budget += scheduled.pop(victim.request_id, 0)
                else:
                    victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it was its own victim: vLLM stops the running pass here too
            if (computed + n) // bs > computed // bs:  # this step fills a block
                kv.cache_blocks(seq.request_id, seq.block_hashes, computed + n)
            scheduled[seq.request_id] = n
            budget -= n
            i += 1

        if not preempted:
            max_seqs = self.config.max_num_seqs
            full_isl = self.config.reserve_full_isl
            while budget > 0 and len(running) < max_seqs and (self.ready or self.waiting):
                queue = self.ready if self.ready else self.waiting
                seq = queue[0]
                rid = seq.request_id
                hits = []
                lookup = seq.num_computed_tokens == 0
                if lookup:
                    hits = kv.find_cached(seq.block_hashes, seq.num_tokens - 1)
                hit_tokens = len(hits) * bs
                reserve = self._watermark_blocks if running else 0
                if full_isl and not kv.can_allocate(rid, seq.num_tokens, hits, reserve):
                    break
                if lookup and seq.remote_prefill is not None:
                    if not kv.allocate(rid, seq.num_prompt_tokens, hits, reserve):
                        break
                    self._record_lookup(seq, hit_tokens)
                    seq.num_cached_tokens = seq.num_prompt_tokens
                    seq.num_computed_tokens = hit_tokens
                    seq.status = Status.WAITING_FOR_REMOTE_KV
                    queue.popleft()
                    self.loading[rid] = seq
                    loads.append(RemoteLoad(rid, seq.num_prompt_tokens - hit_tokens,
                                            seq.remote_prefill))
                    seq.remote_prefill = None  # a later preemption recomputes locally
                    continue
                computed = seq.num_computed_tokens + hit_tokens
                n = min(seq.num_tokens - computed, budget)
                if not kv.allocate(rid, computed + n, hits, reserve):
                    break
                if lookup:
                    self._record_lookup(seq, hit_tokens)
                    if seq.num_cached_tokens < 0:
                        seq.num_cached_tokens = hit_tokens
                seq.num_computed_tokens = computed
                kv.cache_blocks(rid, seq.block_hashes, computed + n)
                queue.popleft()
                running.append(seq)
                seq.status = Status.RUNNING
                scheduled[rid] = n
                budget -= n

        work = self._work(scheduled)
        outputs = self._advance(scheduled)
        return StepResult(work, scheduled, outputs, preempted, loads, kv.take_events())

    def _work(self, scheduled: dict[str, int]) -> StepWork:
        """What the step computes, for the profile: prefill tokens (and their cached
        context), decode sequences (and their context). Before ``_advance``."""
        p_tokens = p_weighted = d_seqs = d_context = 0
        chunks: list[tuple[int, int]] = []
        for rid, n in scheduled.items():
            seq = self.requests[rid]
            computed = seq.num_computed_tokens
            if n == 1 and seq.num_tokens > seq.num_prompt_tokens:
                d_seqs += 1
                d_context += computed + 1
            else:
                p_tokens += n
                p_weighted += n * computed
                chunks.append((n, computed))
        return StepWork(p_tokens, p_weighted, d_seqs, d_context,
                        tuple(chunks) if len(chunks) > 1 else ())  # one: the totals say it

    def _advance(self, scheduled: dict[str, int]) -> list[Delta]:
        """The forward pass's effect: computed tokens move on, new tokens are sampled."""
        outputs: list[Delta] = []
        finished = False
        requests = self.requests
        for rid, n in scheduled.items():
            seq = requests[rid]
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            token = seq.tokens.next()
            seq.append_token(token)
            delta = Delta(rid, [token], None, seq.num_prompt_tokens, seq.num_cached_tokens)
            if seq.num_output_tokens >= seq.max_tokens:
                delta.finish_reason = seq.finish_reason = "length"
                seq.status = Status.FINISHED
                finished = True
                if seq.remote_decode:
                    self.held[rid] = seq
                    delta.kv_transfer_params = seq.kv_transfer_params = self._handoff(seq)
                else:
                    del requests[rid]
                    self.kv.free(rid)
            outputs.append(delta)
        if finished:
            self.running = [s for s in self.running if s.status is Status.RUNNING]
        return outputs

    def _handoff(self, seq: Sequence) -> dict[str, Any]:
        """The prefill side's ``kv_transfer_params``, shaped like vLLM NixlConnector's."""
        computed = seq.num_computed_tokens
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": seq.request_id,
            "remote_block_ids": self.kv.block_ids(seq.request_id),
            "remote_block_hashes": seq.block_hashes[: computed // self.config.block_size],
            "remote_num_tokens": computed,
            "remote_prefill_cached_tokens": max(seq.num_cached_tokens, 0),
            "transfer_mode": "mocker",
        }

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.request_id)
        seq.status = Status.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        if self.config.policy == "priority":
            self._enqueue(seq)
        else:
            self.waiting.appendleft(seq)

    def _record_lookup(self, seq: Sequence, hit_tokens: int) -> None:
        if seq.num_preemptions == 0:  # vLLM counts a preempted request's lookups apart
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += hit_tokens
