"""FfnWorker: serves the FFN (or some MoE experts) of some layers to many decode workers.

Attention-FFN disaggregation (``dynagraph.llm.afd``): the VllmWorker's engine keeps
attention, KV cache and scheduling and sends, per layer and per forward batch, the
hidden states to the FfnWorkers holding that layer; they answer with the FFN output.

An FfnWorker loads only the checkpoint tensors of what it holds, into vLLM's own FFN /
MoE modules (same dtype and kernels as the monolithic model: greedy tokens match), and
serves them on its data plane (``FfnServer``: TCP, and a Unix socket + shared memory
for engines on the same host), not on the request plane: a layer call is too small
and too frequent for it. Its addresses and holdings are published in its discovery
metadata (``afd``); the VllmWorker reads them from etcd before its engine starts.

Holdings (YAML, see ``dynagraph.llm.afd.plan.assign``): ``layers`` (``all``,
``0-1``), ``experts`` (an MoE's expert ids, expert parallel), or ``split: layers`` /
``split: experts`` with ``shards: N``: worker ``i`` of ``ServiceArgs.workers`` holds
shard ``i % N``; workers beyond N are replicas that calls fail over to.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from pydantic import Field

from dynagraph.config import ConfigModel
from dynagraph.errors import ConfigError
from dynagraph.llm.afd.plan import assign, parse_ranges
from dynagraph.llm.afd.settings import PeerInfo
from dynagraph.sdk import Component, async_on_shutdown, async_on_start, endpoint, service

if TYPE_CHECKING:
    from dynagraph.llm.afd.server import FfnServer

# The data plane (torch) is imported where it is used: every decode worker imports this
# module for its ``depends(FfnWorker)`` edge, and torch took 2 of the 2.5 s a
# MockerWorker process needed to import (a Planner's new worker waited for it).

log = logging.getLogger(__name__)


class FfnWorkerConfig(ConfigModel):
    """What this worker holds and how it computes; kebab-case in YAML."""

    model: str
    """The model directory (the VllmWorker's model)."""
    layers: str | list[int] = "all"
    """Layers held: ``all``, ``"0-1,3"`` or a list."""
    experts: str | list[int] | None = None
    """Experts held of each layer (MoE only; None or ``all``: the whole FFN)."""
    split: Literal["none", "layers", "experts"] = "none"
    """Split ``layers`` / the experts over ``shards`` workers by worker index."""
    shards: int = Field(default=1, ge=1)
    threads: int | None = Field(default=None, ge=1)
    """Torch intra-op threads for the FFN (None: torch's default). With more than one,
    set ``OMP_WAIT_POLICY: PASSIVE`` in ``ServiceArgs.env`` when engines share the cores
    (OpenMP's idle threads spin otherwise)."""
    cpus: str | None = None
    """CPU affinity of this worker (``"1"``, ``"2-3"``); None: any CPU."""
    host: str | None = None
    """Address the TCP data plane binds and publishes (default ``DYNAMO_HOST`` or
    127.0.0.1)."""
    dtype: str = "auto"
    """Must match the VllmWorker's dtype (the connection is refused otherwise)."""


class FfnInfoRequest(ConfigModel):
    """Request of the ``info`` endpoint (no fields)."""


class FfnInfo(msgspec.Struct, kw_only=True):
    """Answer of the ``info`` endpoint (a diagnostic)."""

    peer: dict[str, Any]
    """Where it listens and what it holds (``PeerInfo``)."""
    calls: int
    rows: int
    compute_seconds: float
    errors: int
    connections: int


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class FfnWorker(Component):
    def __init__(self, config: FfnWorkerConfig) -> None:
        from dynagraph.llm.afd.model_info import read_model_info

        self.config = config
        info = read_model_info(config.model)
        try:
            self.layers, self.experts = assign(
                info.num_layers, info.num_experts, layers=config.layers, experts=config.experts,
                split=config.split, shards=config.shards, index=self.runtime.worker_index)
        except ValueError as exc:
            raise ConfigError(str(exc), component="FfnWorker") from exc
        self.server: FfnServer | None = None
        self.peer: PeerInfo | None = None

    @async_on_start
    async def start(self) -> None:
        from dynagraph.llm.afd.ffn import VllmFfn
        from dynagraph.llm.afd.metrics import register_ffn_stats
        from dynagraph.llm.afd.server import FfnServer
        from dynagraph.runtime.addresses import host_id

        cfg, rt = self.config, self.runtime
        if cfg.cpus is not None:
            os.sched_setaffinity(0, parse_ranges(cfg.cpus, os.cpu_count() or 1, "cpus"))
        ffn = await asyncio.to_thread(VllmFfn, cfg.model, self.layers, self.experts,
                                      threads=cfg.threads, dtype=cfg.dtype)
        instance = f"{rt.instance_id:x}"
        host = cfg.host or os.environ.get("DYNAMO_HOST", "").strip() or "127.0.0.1"
        self.server = FfnServer(ffn, host=host, instance=instance,
                                uds_name=f"dynagraph-afd-{instance}")
        self.server.start()
        self.peer = PeerInfo(instance=instance, model=ffn.model, tcp=self.server.tcp_address,
                             uds=self.server.uds_address, host=host_id(), layers=ffn.layers,
                             experts=ffn.experts)
        rt.metadata["afd"] = self.peer.model_dump()
        register_ffn_stats(self.server.stats, worker=instance, registry=rt.registry)
        log.info("FFN worker ready: layers %s%s of %s", ffn.layers,
                 "" if ffn.experts is None else f", experts {ffn.experts}", ffn.model)

    @async_on_shutdown
    async def stop(self) -> None:
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)

    @endpoint()
    async def info(self, request: FfnInfoRequest) -> AsyncGenerator[FfnInfo, None]:
        """What this worker holds, where it listens, and its call counters."""
        assert self.server is not None and self.peer is not None
        s = self.server.stats
        yield FfnInfo(peer=self.peer.model_dump(), calls=s.calls, rows=s.rows,
                      compute_seconds=s.compute_seconds, errors=s.errors,
                      connections=s.connections)
