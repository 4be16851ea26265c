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
                          "kv_connector_module_path": "dynagraph.llm.kv.transfer.nixl_connector", ...}

The delay comes from ``DYNAGRAPH_NIXL_PROGRESS_DELAY_US`` (set by
``nixl_side.prepare_nixl`` from ``nixl-progress-delay-us``; default 10000; 0 keeps
NIXL's busy-spin).

With ``DYNAGRAPH_KV_SHM=1`` (``kv-transport: shm`` or ``auto``) the engine's KV cache is
allocated in shared memory and published, and its READs from same-host peers that did
the same are copies (``dynagraph.llm.kv.transfer.shm_direct``).

With ``DYNAGRAPH_KV_WIRE_CODEC`` (``kv-transfer-compression``) the KV crosses the NIXL
wire encoded (``dynagraph.llm.kv.transfer.wire_codec``): the prefill side encodes a remote-decode
request's blocks after the forward pass that computed them (vLLM's scheduler lists them
as for a host buffer), the decode side reads the encoded bytes and decodes them.

Each step polls the KV reads it has just posted for up to ``DYNAGRAPH_NIXL_SETTLE_US``
(``nixl-settle-us``, default 2000) so that the same step reports them done
(``dynagraph.llm.kv.transfer.nixl_settle``).

Where the engines sit: on the CPU, vLLM's NIXL worker binds the thread that creates it to
the last core of each NUMA node. Our NIXL engines run their model in the engine-core
process, so that thread is the engine core's main thread, which also runs the forward
passes: every NIXL engine of a host runs there (``cpu-threads-bind`` has no say), and
``dynamo serve``'s core keeper then keeps the graph's own processes on the other cores and
leaves the engines at niceness 0. That binding is kept on purpose (the A/Bs behind it:
``benchmarks/results/HISTORY.md``).

Every patch of vLLM or NIXL internals made here goes through
``dynagraph.llm.engines.vllm.adapter``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)

from dynagraph.llm.engines.vllm import adapter
from dynagraph.llm.kv.transfer import (
    nixl_settle,
    shm_direct,
    shm_memory,
    wire_codec,
    wire_shadow,
)
from dynagraph.llm.kv.transfer.nixl_side import (
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
    if delay > 0 and adapter.wrap_nixl_agent_config(  # no NIXL: vLLM fails later
            lambda config: delayed_agent_config(config, delay)):
        log.info("NIXL progress thread sleeps up to %d us between UCX events", delay)
    return delay


install()


def _rehome(kv_caches: Any) -> None:
    """A KV cache vLLM just allocated, its buffer moved to a memfd before anything views it."""
    region = shm_memory.rehome(kv_caches)
    if region is not None:
        log.info("KV cache in shared memory (%.2f GiB)", region.nbytes / 2**30)


if shm_direct.enabled():
    adapter.after_kv_cache_allocation(_rehome)


_CODEC_AGENTS: list[wire_codec.CodecNixl] = []
"""This process's encoding agents (one per connector), for the quality guard's RPC."""


def _wire_roundtrip(_worker: Any) -> int:
    """Every KV byte of this process's encoding engines replaced by its codec round trip;
    returns the bytes."""
    return sum(agent.roundtrip_all() for agent in _CODEC_AGENTS)


if wire_codec.wire_codec() is not None:
    adapter.add_worker_rpc(wire_codec.ROUNDTRIP_RPC, _wire_roundtrip)


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
        if shm_direct.enabled():
            adapter.wrap_nixl_agent(self, shm_direct.ShmNixl)
        self._settle_s = settle_budget_from_env()
        self._codec: wire_codec.CodecNixl | None = None
        self._tails: dict[str, int] = {}
        name = wire_codec.wire_codec()
        if name is not None:
            adapter.list_remote_decode_saves(self)
            self._codec = adapter.wrap_nixl_agent(
                self, lambda agent: wire_codec.CodecNixl(agent, name))
            if self._codec is not None:
                _CODEC_AGENTS.append(self._codec)

    def shutdown(self) -> None:
        adapter.stop_handshake_listener(self, LISTENER_JOIN_S)
        if self._published is not None:
            shm_memory.withdraw(self._published)
            self._published = None
        if self._codec in _CODEC_AGENTS:
            _CODEC_AGENTS.remove(self._codec)
        super().shutdown()  # type: ignore[no-untyped-call]  # vLLM's method is unannotated

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = adapter.connector_worker(self)
        recving = adapter.receiving_transfers(self)
        if self._settle_s <= 0 or worker is None or recving is None:
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
        worker = adapter.connector_worker(self)
        if worker is None or not shm_direct.enabled():
            return
        regions = shm_memory.regions_of(t.data_ptr() for t in kv_caches.values())
        if regions:
            agent = str(worker.nixl_wrapper.name)
            shm_memory.publish(agent, regions)
            self._published = agent

    def wait_for_save(self) -> None:
        super().wait_for_save()  # type: ignore[no-untyped-call]
        if self._codec is not None:
            self._encode_saved()

    def _encode_saved(self) -> None:
        """Encode this step's blocks of remote-decode requests into the wire shadow (and
        each one's last block of the step before, which this step may have filled)."""
        todo = adapter.blocks_to_save(self)
        worker = adapter.connector_worker(self)
        if not todo or worker is None or self._codec is None:
            return
        bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
        for req_id, req in todo.items():
            ids = adapter.kernel_block_ids(worker, req.local_block_ids)
            if not ids:
                continue
            tail = self._tails.pop(req_id, None)
            if tail is not None and tail not in ids:
                ids.insert(0, tail)
            self._tails[req_id] = ids[-1]
            while len(self._tails) > TAILS_KEPT:
                del self._tails[next(iter(self._tails))]
            addrs, lens = wire_shadow.block_ranges(bases, worker.block_len_per_layer,
                                                   worker.block_stride_per_layer, ids)
            if not self._codec.encode(addrs, lens):
                log.warning("request %s: its KV blocks are not in the wire shadow", req_id)
