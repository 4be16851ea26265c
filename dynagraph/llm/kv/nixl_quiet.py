"""vLLM's ``NixlConnector`` with NIXL's progress thread asleep while idle.

vLLM makes its NIXL agents with ``nixl._api``'s hard-coded ``pthrDelay = 0``: the
progress thread busy-spins, a full core per engine while idle. The thread waits on UCX
event file descriptors and uses the delay only as a poll timeout, so a non-zero delay
keeps it event-driven: a 2 MiB READ with notification still completes in ~0.2 ms, at
< 0.01 cores idle (``benchmarks/nixl_progress.py``). The thread must stay on: without it
the first transfer into an idle engine never completes (nobody polls its agent).

vLLM imports this module inside each engine-core process (name it as the connector's
module path; the class keeps the name ``NixlConnector`` so vLLM's own
``has_connector("NixlConnector")`` checks hold)::

    kv_transfer_config = {"kv_connector": "NixlConnector",
                          "kv_connector_module_path": "dynagraph.llm.kv.nixl_quiet", ...}

The delay comes from ``DYNAGRAPH_NIXL_PROGRESS_DELAY_US`` (set by
``nixl_side.prepare_nixl`` from ``nixl-progress-delay-us``; default 10000; 0 keeps
NIXL's busy-spin).

With ``DYNAGRAPH_KV_SHM=1`` (``kv-transport: shm`` or ``auto``) the engine's KV cache is
allocated in shared memory and published, and its READs from same-host peers that did
the same are copies (``dynagraph.llm.kv.shm_direct``).

With ``DYNAGRAPH_KV_WIRE_CODEC`` (``kv-transfer-compression``) the KV crosses the NIXL
wire encoded (``dynagraph.llm.kv.wire_codec``): the prefill side encodes a remote-decode
request's blocks after the forward pass that computed them (vLLM's scheduler lists them
as for a host buffer), the decode side reads the encoded bytes and decodes them.

Each step polls the KV reads it has just posted for up to ``DYNAGRAPH_NIXL_SETTLE_US``
(``nixl-settle-us``, default 2000) so that the same step reports them done
(``dynagraph.llm.kv.nixl_settle``).

Where the engines sit: on the CPU, vLLM's NIXL worker binds the thread that creates it to
the last core of each NUMA node ("reserve different cores for start_load_kv() from
model_forward()"). Our NIXL engines run their model in the engine-core process, so that
thread is the engine core's main thread, which also runs the forward passes: every NIXL
engine of a host runs there (core 1 of a 2-core box; ``cpu-threads-bind`` has no say),
and ``dynamo serve``'s core keeper then keeps the graph's own processes on the other
cores and leaves the engines at niceness 0. That binding is kept on purpose; two scratch
A/Bs on 2 cores (2026-12-06, ``benchmarks/results/disagg_*_nixl_bind_*.md``):

- Every thread it bound put back on the engine's cores (the engines float, the keeper
  renices them to 19): one request at a time, 4k-token transfers 1.9 -> 0.77 ms over
  NIXL and 0.79 -> 0.50 ms over shared memory in one pair of runs; but under a steady
  load of 6 streams on ``disagg_router`` (three engines) the graph completed 82 / 79
  requests in 60 s against 277 / 264, inter-token p50 26-27 ms against 2.4-2.8 ms, at
  niceness 19 or 0 alike.
- Each engine on its worker's own ``cpu-threads-bind`` cores instead (decode core 0,
  prefill core 1): one request at a time no different; under the same load 197 / 231
  completed (210 / 186 at niceness 0) against 236 / 246 kept, with a lower TTFT p99
  (0.7-1.0 s against 1.7-1.8 s).

Where a served NIXL READ's time goes (decode engine, one 1k-token request at a time,
scratch ``perf`` of the engine with markers around each ``transfer()``, 2026-12-06): the
copy (UCX's CMA, ``process_vm_readv``) runs at raw speed, 0.05-0.19 ms. But the agent
vLLM made after binding started NIXL's progress thread, UCX's async thread and NIXL's
dedicated workers on that same core, and UCX does a same-host READ in worker progress:
the main thread and the progress thread take turns at the worker's spinlock, and the
main thread spun ~0.1 ms a post (``pthread_spin_lock``), about as long as the copy. In
~15% of posts the prefill engine's main thread (same core) preempted it for 0.2-1.4 ms.
Without the progress thread it was worse (run medians 0.99-2.1 ms at 1k against
0.30-0.69 ms with it, scratch). Moving only the threads made while vLLM built the
connector to the other core (a scratch toggle,
``benchmarks/results/nixl_helpers_ab.md``): one request at a time, pooled medians 0.45
-> 0.37 ms at 1k and 1.27 -> 1.00 ms at 4k, p90 halved; under ``disagg_load`` the same
requests completed, but the graph's core then did the copies and 5 etcd leases were lost
in 4 runs (none in 2 without, none in 16 earlier that day, stop 42). Not shipped. Nor
was a larger ``UCX_CMA_TX_QUOTA`` (how many segments UCX's CMA transport copies per
progress call; 1 by default): 1024 made single transfers faster in 7 of 8 interleaved
pairs, but under load the graph completed 189 / 190 requests against 201-264 with UCX's 1;
64 left load alone and was a coin toss one request at a time
(``benchmarks/results/nixl_cma_quota_ab.md``). That A/B's note counted a 1k READ as up to
256 segments, one per 8 KiB descriptor; but NIXL merges the descriptors that are
contiguous on both sides before UCX sees them (a scratch READ of 256 contiguous 8 KiB
descriptors: ``descCount`` 1 in NIXL's telemetry, as fast as one 2 MiB descriptor; 256
scattered ones took 4x as long), and a request's blocks are mostly consecutive on both
sides, so a 1k READ is a handful of descriptors, about one per (layer, K/V) region. Nor
was UCX's mutex for the worker lock instead of its spinlock (``UCX_USE_MT_MUTEX=y`` for
the whole graph; three interleaved pairs of ``benchmarks/disagg_served.py --requests 24
--transports nixl --raw-from file``, 2026-12-06): pooled medians 0.29 / 0.87 ms at 1k /
4k against 0.26 / 0.82 ms with the spinlock, 72 transfers each.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)

from dynagraph.llm.kv import nixl_settle, shm_direct, wire_codec
from dynagraph.llm.kv.nixl_side import (
    delayed_agent_config,
    progress_delay_from_env,
    settle_budget_from_env,
)

log = logging.getLogger(__name__)

MODULE_PATH = __name__


def install(environ: Any = os.environ) -> int:
    """Give NIXL agents made from now on the configured progress-thread delay (idempotent).

    Returns the delay in microseconds (0: NIXL's busy-spinning default is kept).
    """
    delay = progress_delay_from_env(environ)
    if getattr(_base_worker, "nixl_agent_config", None) is None:  # no NIXL: vLLM fails later
        return delay
    if delay > 0:
        import nixl._api as api  # the module vLLM's agents come from

        bindings = api.nixlBind
        bindings.nixlAgentConfig = delayed_agent_config(bindings.nixlAgentConfig, delay)
        log.info("NIXL progress thread sleeps up to %d us between UCX events", delay)
    return delay


install()


def _shared_kv_allocation() -> None:
    """vLLM's KV cache allocation, its buffer moved to a memfd before anything views it."""
    from vllm.v1.worker import gpu_model_runner as runner

    allocate = getattr(runner, "allocate_kv_cache")  # noqa: B009  (imported there, not exported)
    if getattr(allocate, "__dynagraph_shm__", False):
        return

    def allocate_shared(*args: Any, **kwargs: Any) -> Any:
        kv_caches = allocate(*args, **kwargs)
        region = shm_direct.rehome(kv_caches)
        if region is not None:
            log.info("KV cache in shared memory (%.2f GiB)", region.nbytes / 2**30)
        return kv_caches

    allocate_shared.__dynagraph_shm__ = True  # type: ignore[attr-defined]
    setattr(runner, "allocate_kv_cache", allocate_shared)  # noqa: B010


if shm_direct.enabled():
    _shared_kv_allocation()


_CODEC_AGENTS: list[wire_codec.CodecNixl] = []
"""This process's encoding agents (one per connector), for the quality guard's RPC."""


def _wire_roundtrip(_worker: Any) -> int:
    """Every KV byte of this process's encoding engines replaced by its codec round trip;
    returns the bytes."""
    return sum(agent.roundtrip_all() for agent in _CODEC_AGENTS)


if wire_codec.wire_codec() is not None:
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    setattr(WorkerWrapperBase, wire_codec.ROUNDTRIP_RPC, _wire_roundtrip)


LISTENER_JOIN_S = 1.5
TAILS_KEPT = 1024
"""Requests whose last encoded block is remembered (a chunked prefill's next chunk may
complete that block)."""


class NixlConnector(_VllmNixlConnector):
    """vLLM's NixlConnector; importing this module removed the idle busy-spin.

    ``shutdown`` bounds the join of vLLM's handshake-listener thread (a daemon): vLLM's
    unbounded join outlasted the engine's 5 s shutdown budget, so every NIXL engine was
    force-killed on exit.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._published: str | None = None
        worker = getattr(self, "connector_worker", None)
        if worker is not None and shm_direct.enabled():
            worker.nixl_wrapper = shm_direct.ShmNixl(worker.nixl_wrapper)
        self._settle_s = settle_budget_from_env()
        self._codec: wire_codec.CodecNixl | None = None
        self._tails: dict[str, int] = {}
        name = wire_codec.wire_codec()
        if name is not None:
            sched = getattr(self, "connector_scheduler", None)
            if sched is not None:  # it lists a remote-decode request's blocks to save
                sched.use_host_buffer = True
            if worker is not None:
                self._codec = wire_codec.CodecNixl(worker.nixl_wrapper, name)
                worker.nixl_wrapper = self._codec
                _CODEC_AGENTS.append(self._codec)

    def shutdown(self) -> None:
        sched = getattr(self, "connector_scheduler", None)
        listener = getattr(sched, "_nixl_handshake_listener_t", None)
        if sched is not None and listener is not None:
            sched._stop_event.set()
            listener.join(timeout=LISTENER_JOIN_S)
            sched._nixl_handshake_listener_t = None
        if self._published is not None:
            shm_direct.withdraw(self._published)
            self._published = None
        if self._codec in _CODEC_AGENTS:
            _CODEC_AGENTS.remove(self._codec)
        super().shutdown()  # type: ignore[no-untyped-call]  # vLLM's method is unannotated

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = getattr(self, "connector_worker", None)
        recving = getattr(worker, "_recving_transfers", None)
        if self._settle_s <= 0 or worker is None or not isinstance(recving, dict):
            super().start_load_kv(forward_context, **kwargs)
            return
        before = nixl_settle.in_flight(recving)
        super().start_load_kv(forward_context, **kwargs)
        posted = nixl_settle.posted_since(recving, before)
        if posted:
            nixl_settle.settle(worker.nixl_wrapper.check_xfer_state, posted, self._settle_s)

    def register_kv_caches(self, kv_caches: Any) -> None:
        if self._codec is not None and kv_caches:
            self._codec.dtype = next(iter(kv_caches.values())).dtype
        super().register_kv_caches(kv_caches)
        worker = getattr(self, "connector_worker", None)
        if worker is None or not shm_direct.enabled():
            return
        regions = shm_direct.regions_of(t.data_ptr() for t in kv_caches.values())
        if regions:
            agent = str(worker.nixl_wrapper.name)
            shm_direct.publish(agent, regions)
            self._published = agent

    def wait_for_save(self) -> None:
        super().wait_for_save()  # type: ignore[no-untyped-call]
        if self._codec is not None:
            self._encode_saved()

    def _encode_saved(self) -> None:
        """Encode this step's blocks of remote-decode requests into the wire shadow (and
        each one's last block of the step before, which this step may have filled)."""
        todo = getattr(getattr(self, "_connector_metadata", None), "reqs_to_save", None)
        worker = getattr(self, "connector_worker", None)
        if not todo or worker is None or self._codec is None:
            return
        bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
        for req_id, req in todo.items():
            groups = worker._logical_to_kernel_block_ids(
                req.local_block_ids, worker._physical_blocks_per_logical_kv_block)
            ids = [b for group in groups for b in group]
            if not ids:
                continue
            tail = self._tails.pop(req_id, None)
            if tail is not None and tail not in ids:
                ids.insert(0, tail)
            self._tails[req_id] = ids[-1]
            while len(self._tails) > TAILS_KEPT:
                del self._tails[next(iter(self._tails))]
            addrs, lens = wire_codec.block_ranges(bases, worker.block_len_per_layer,
                                                  worker.block_stride_per_layer, ids)
            if not self._codec.encode(addrs, lens):
                log.warning("request %s: its KV blocks are not in the wire shadow", req_id)
