"""Planner: scales the decode and prefill workers of its graph from their load.

Linked into a graph (``graphs/mocker_planner.py``, ``graphs/mocker_disagg_planner.py``)
it finds the decode workers through its ``depends(VllmWorker)`` edge (a MockerWorker
stands in for it) and the prefill workers through ``depends(PrefillWorker)`` (absent in
an aggregated graph). Every ``metric-pulling-interval`` it samples the decode engines'
load (their ``load_metrics`` streams, as the Router reads them) and the prefill-queue
depth (NATS JetStream); every ``adjustment-interval`` it averages the samples
(``dynagraph.planner.observer``), asks ``dynagraph.planner.policy.decide`` for the
replica counts (and between adjustments, ``surge`` for a scale-up judged on the last
``surge-window`` seconds: up fast, down slow), and applies a change through the
connector: ``EtcdScaleConnector`` writes ``/{namespace}/scale/{Component}``, which
``dynamo serve`` follows (starting workers, or retiring them: a retired worker drains
its requests first).

A replica is one worker process (``engines-per-process`` engines). ``no-operation: true``
decides and reports without scaling. The ``status`` endpoint returns the current targets,
the serving counts and the decisions so far.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, Literal

import msgspec
from pydantic import Field

from components.prefill_worker import PrefillWorker
from components.worker import VllmWorker
from dynagraph.aio import cancel_and_wait
from dynagraph.errors import ConfigError, DynagraphError
from dynagraph.planner import (
    Decision,
    PlannerPolicy,
    PlannerState,
    Replicas,
    decide,
    pressures,
    surge,
)
from dynagraph.planner.connector import Connector, EtcdScaleConnector
from dynagraph.planner.kubernetes import SERVICE_ACCOUNT, KubernetesConnector, KubeScaleApi
from dynagraph.planner.observer import LoadFollower, LoadWindow, Sample
from dynagraph.runtime.queue import NatsPrefillQueue
from dynagraph.sdk import Component, async_on_shutdown, async_on_start, depends, endpoint, service
from dynagraph.sdk._service import spec_of

log = logging.getLogger(__name__)

MAX_HISTORY = 10_000


class PlannerConfig(PlannerPolicy):
    """The policy's keys (``PlannerPolicy``) and the loop's; kebab-case in YAML."""

    adjustment_interval: float = Field(default=10.0, gt=0)
    """Seconds between two decisions."""
    metric_pulling_interval: float = Field(default=1.0, gt=0)
    """Seconds between two load samples."""
    no_operation: bool = False
    """Decide and report, never scale."""
    prefill_queue_ack_wait: float = Field(default=3.0, gt=0)
    """As the workers' (``Common``): connecting to the queue sets its consumer's values."""
    prefill_queue_max_deliver: int = Field(default=3, ge=1)
    connector: Literal["dynamo-serve", "kubernetes"] = "dynamo-serve"
    """``dynamo-serve``: the scale keys ``dynamo serve`` follows; ``kubernetes``: the
    Deployments ``dynamo deploy k8s`` made (``k8s-graph-name``, ``k8s-namespace``)."""
    k8s_graph_name: str | None = None
    """The ``--name`` the graph was deployed with."""
    k8s_namespace: str | None = None
    """Default: the Planner pod's own namespace."""


class PlannerStatusRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Request of the ``status`` endpoint: the decisions from index ``since`` on."""

    since: int = 0


class PlannerStatus(msgspec.Struct, kw_only=True):
    """Answer of the ``status`` endpoint (a diagnostic)."""

    decode_component: str
    prefill_component: str | None
    target: dict[str, int]
    serving: dict[str, int]
    decisions: list[dict[str, Any]]


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1, controller=True)
class Planner(Component):
    decode = depends(VllmWorker)
    prefill = depends(PrefillWorker)

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self.policy = PlannerPolicy.model_validate(
            config.model_dump(include=set(PlannerPolicy.model_fields)))
        self.connector = _connector(config, self.runtime.discovery, self.runtime.namespace)
        self.window = LoadWindow()
        self.state = PlannerState()
        self.target: Replicas | None = None
        self.serving = Replicas(0, 0)
        self.history: list[dict[str, Any]] = []
        self.follower: LoadFollower | None = None
        self.queue: NatsPrefillQueue | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def decode_component(self) -> str:
        return str(getattr(self.decode, "component", spec_of(VllmWorker).name))

    @property
    def prefill_component(self) -> str | None:
        if self.prefill is None:
            return None
        return str(getattr(self.prefill, "component", spec_of(PrefillWorker).name))

    @async_on_start
    async def start(self) -> None:
        if self.decode is None:
            raise DynagraphError("the Planner needs decode workers (a VllmWorker or a "
                                 "stand-in) in its graph")
        rt = self.runtime
        ns = getattr(self.decode, "namespace", rt.namespace)
        watch = await rt.discovery.watch_instances(ns, self.decode_component, "load_metrics")
        self.follower = LoadFollower(self.decode.load_metrics, watch)
        if self.prefill is not None and rt.nats_url is not None:
            self.queue = NatsPrefillQueue(rt.nats_url, rt.namespace,
                                          ack_wait=self.config.prefill_queue_ack_wait,
                                          max_deliver=self.config.prefill_queue_max_deliver)
            await self.queue.connect()
        self._task = asyncio.create_task(self._run(), name="planner")
        log.info("planning %s%s every %.0fs (budget %d GPUs)%s", self.decode_component,
                 f" and {self.prefill_component}" if self.prefill_component else "",
                 self.config.adjustment_interval, self.policy.gpu_budget,
                 " (no-operation)" if self.config.no_operation else "")

    @async_on_shutdown
    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        if self.follower is not None:
            await self.follower.close()
        if self.queue is not None:
            await self.queue.close()

    @endpoint()
    async def status(self, request: PlannerStatusRequest
                     ) -> AsyncGenerator[PlannerStatus, None]:
        """Targets, serving counts and the decisions so far (``since``: from that index)."""
        target = self.target or Replicas(0, 0)
        yield PlannerStatus(
            decode_component=self.decode_component, prefill_component=self.prefill_component,
            target={"prefill": target.prefill, "decode": target.decode},
            serving={"prefill": self.serving.prefill, "decode": self.serving.decode},
            decisions=self.history[request.since:])

    # -- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        next_adjust = time.monotonic() + self.config.adjustment_interval
        while True:
            try:
                await self._sample()
                if time.monotonic() >= next_adjust:
                    next_adjust += self.config.adjustment_interval
                    await self._adjust()
                elif (self.target is not None and self.policy.surge_window > 0
                      and not self.config.no_operation):
                    await self._surge()
            except (DynagraphError, TimeoutError) as exc:
                log.warning("planner step failed: %s", exc)
            await asyncio.sleep(self.config.metric_pulling_interval)

    async def _sample(self) -> None:
        assert self.follower is not None
        depth = 0
        if self.queue is not None:
            async with asyncio.timeout(5):
                depth = (await self.queue.stats()).waiting
        self.window.add(Sample.of(self.follower.current(), depth))

    async def _read_serving(self) -> Replicas:
        async with asyncio.timeout(5):
            decode = await self.connector.serving(self.decode_component)
            pc = self.prefill_component
            prefill = await self.connector.serving(pc) if pc is not None else 0
        self.serving = Replicas(prefill, decode)
        return self.serving

    async def _adjust(self) -> None:
        serving = await self._read_serving()
        obs = self.window.observe(serving.decode, serving.prefill)
        if self.target is None:  # the counts the graph started with, within the bounds
            p = self.policy
            self.target = Replicas(
                min(max(serving.prefill, p.min_prefill_replicas), p.max_prefill_replicas),
                min(max(serving.decode, p.min_decode_replicas), p.max_decode_replicas))
        await self._apply(decide(self.policy, self.state, obs, self.target, serving), obs)

    async def _surge(self) -> None:
        """Between adjustments: a scale-up judged on the last ``surge-window`` seconds."""
        assert self.target is not None
        count = max(1, round(self.policy.surge_window / self.config.metric_pulling_interval))
        # on the serving counts last read: no etcd read per sample while nothing presses
        if max(pressures(self.policy, self.window.recent(
                count, self.serving.decode, self.serving.prefill))) < 1.0:
            return
        serving = await self._read_serving()
        obs = self.window.recent(count, serving.decode, serving.prefill)
        d = surge(self.policy, self.state, obs, self.target, serving)
        if d is not None:
            await self._apply(d, obs, surged=True)

    async def _apply(self, d: Decision, obs: Any, *, surged: bool = False) -> None:
        assert self.target is not None
        self._record(d, obs, surged=surged)
        pc = self.prefill_component
        if d.changed and not self.config.no_operation:
            if d.target.decode != self.target.decode:
                await self.connector.set_replicas(self.decode_component, d.target.decode)
            if pc is not None and d.target.prefill != self.target.prefill:
                await self.connector.set_replicas(pc, d.target.prefill)
            log.info("scaling%s: prefill %d -> %d (%s), decode %d -> %d (%s)",
                     " (surge)" if surged else "", self.target.prefill, d.target.prefill,
                     d.reasons[0], self.target.decode, d.target.decode, d.reasons[1])
        self.state = d.state
        if not self.config.no_operation:
            self.target = d.target

    def _record(self, d: Decision, obs: Any, *, surged: bool = False) -> None:
        self.history.append({
            "t": time.time(), "interval": self.state.interval, "surge": surged,
            "serving": [self.serving.prefill, self.serving.decode],
            "target": [d.target.prefill, d.target.decode], "reasons": list(d.reasons),
            "pressure": [round(x, 4) for x in d.pressure],
            "kv_usage": round(obs.decode_kv_usage, 4), "waiting": round(obs.decode_waiting, 4),
            "prefill_queue": round(obs.prefill_queue, 4)})
        del self.history[:-MAX_HISTORY]


def _connector(config: PlannerConfig, discovery: Any, namespace: str) -> Connector:
    if config.connector == "dynamo-serve":
        return EtcdScaleConnector(discovery, namespace)
    if not config.k8s_graph_name:
        raise ConfigError("the kubernetes connector needs k8s-graph-name", component="Planner",
                          key="k8s-graph-name")
    k8s_ns = config.k8s_namespace or (SERVICE_ACCOUNT / "namespace").read_text().strip()
    return KubernetesConnector(KubeScaleApi.in_cluster(), k8s_ns, config.k8s_graph_name,
                               discovery, namespace)
