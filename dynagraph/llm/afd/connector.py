"""The AFD connector: the engine side of the per-layer tensor exchange.

The AFD model calls, per layer and per (micro-)batch::

    call = connector.submit(layer, hidden)   # sends, returns at once
    ...                                      # e.g. the other micro-batch's attention
    out = connector.collect(call)            # blocks until the FFN output is back

``submit`` routes the layer (``RouteTable``) to one FfnWorker holding its whole FFN,
or to one worker per expert group (expert parallel); ``collect`` adds expert-group
partials in float32 and rounds once. Both run inside vLLM's synchronous forward pass,
on blocking channels (``FfnChannel``), so there is no event loop to share.

Failover: an FFN call is a pure function of its input, so a call whose worker broke,
timed out or went away is sent again to another worker holding the same layer (the
connector keeps the input until the call is collected). When no live worker can
compute a layer the connector re-reads the AFD file (the VllmWorker rewrites it from
etcd as workers come and go, a restarted one included) every ``RETRY_INTERVAL_S``
until ``failover_timeout_s``, then raises ``AfdUnavailable`` after writing why to
``error_file``, so the VllmWorker can tell its callers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dynagraph.llm.afd.channel import Endpoint, FfnChannel
from dynagraph.llm.afd.errors import AfdError, AfdUnavailable, ChannelError
from dynagraph.llm.afd.plan import Route, RouteTable
from dynagraph.llm.afd.settings import (
    AfdEngineConfig,
    EngineFailure,
    PeerInfo,
    read_engine_config,
    write_atomic,
    write_failure,
)
from dynagraph.runtime.addresses import host_id

log = logging.getLogger(__name__)

RETRY_INTERVAL_S = 0.1
STATS_INTERVAL_S = 0.5
"""How often the connector's writer thread rewrites its stats file (when they changed)."""


@dataclass
class ExchangeStats:
    """Engine-side exchange counters, written to ``stats_file`` (the VllmWorker exports
    them as ``dynamo_worker_afd_*``) and read directly by benchmarks."""

    forwards: int = 0
    microbatched_forwards: int = 0
    """Forward passes run as two micro-batches in ping-pong."""
    calls: int = 0
    parts: int = 0
    failovers: int = 0
    submit_seconds: float = 0.0
    """Time spent inside ``submit`` (copy + send)."""
    wait_seconds: float = 0.0
    """Time spent blocked inside ``collect``."""
    worker_compute_us: int = 0


@dataclass
class LayerCall:
    """A submitted layer call: what to resend on failover and where the parts went."""

    layer: int
    hidden: torch.Tensor
    parts: list[tuple[Route, FfnChannel, int]] = field(default_factory=list)


class AfdConnector:
    """Sends layer FFN calls to FfnWorkers listed in the AFD file (see module doc)."""

    def __init__(self, config_path: str | Path, *, num_layers: int, num_experts: int,
                 hidden_size: int, dtype: torch.dtype, max_rows: int, client: str | None = None,
                 prefer: int | None = None) -> None:
        self.path = Path(config_path)
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.max_rows = max_rows
        self.client = client or f"engine-{os.getpid()}"
        self.prefer = os.getpid() if prefer is None else prefer
        self.host = host_id()
        self.stats = ExchangeStats()
        self._mtime_ns = -1
        self._stats_writer: threading.Thread | None = None
        self._closed = threading.Event()
        self._channels: dict[str, FfnChannel] = {}
        self._dead: set[str] = set()
        self.config: AfdEngineConfig = self._load(force=True)

    # ------------------------------------------------------------------ peers

    def _load(self, force: bool = False) -> AfdEngineConfig:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError as exc:
            if force:
                raise AfdUnavailable(f"cannot read the AFD file {self.path}: {exc}") from exc
            return self.config
        if not force and mtime == self._mtime_ns:
            return self.config
        config = read_engine_config(self.path)
        self._mtime_ns = mtime
        self.config = config
        live = {p.instance for p in config.peers}
        for instance in list(self._channels):
            if instance not in live:
                self._channels.pop(instance).close()
        self._dead &= live  # a dead instance that is gone cannot come back with that id
        self.table = RouteTable(config.peers, num_layers=self.num_layers,
                                num_experts=self.num_experts)
        return config

    def refresh(self) -> None:
        """Re-read the AFD file if it changed (cheap: one ``stat``); call once per forward
        pass. The stats are published by a thread every ``STATS_INTERVAL_S`` while they
        change, so the counts of a burst's last forwards are not held back until the next
        forward (they once were: an idle engine's metrics stayed stale)."""
        self._load()
        if self.config.stats_file and self._stats_writer is None:
            self._stats_writer = threading.Thread(target=self._write_stats, daemon=True,
                                                  name="afd-stats")
            self._stats_writer.start()

    def _write_stats(self) -> None:
        written = None
        while not self._closed.wait(STATS_INTERVAL_S):
            text = json.dumps(asdict(self.stats))
            if text == written or not self.config.stats_file:
                continue
            try:
                write_atomic(Path(self.config.stats_file), text)
                written = text
            except OSError:
                log.exception("cannot write the AFD stats file")

    @property
    def ping_pong(self) -> bool:
        return self.config.ping_pong

    @property
    def microbatch_min_tokens(self) -> int:
        return self.config.microbatch_min_tokens

    def _transport(self, peer: PeerInfo) -> str:
        kind = self.config.transport
        if kind == "auto":
            return "shm" if peer.uds and peer.host == self.host else "tcp"
        return kind

    def _channel(self, peer: PeerInfo) -> FfnChannel:
        ch = self._channels.get(peer.instance)
        if ch is not None and ch.connected:
            return ch
        ch = FfnChannel(Endpoint(peer.instance, peer.tcp, peer.uds, peer.host),
                        self._transport(peer),  # type: ignore[arg-type]  # validated Literal
                        model=self.config.model, hidden_size=self.hidden_size, dtype=self.dtype,
                        client=self.client, max_rows=self.max_rows,
                        timeout_s=self.config.call_timeout_s)
        ch.connect()
        self._channels[peer.instance] = ch
        return ch

    def _mark_dead(self, peer: PeerInfo, why: Exception) -> None:
        if peer.instance not in self._dead:
            log.warning("FfnWorker %s failed (%s); failing over", peer.instance, why)
        self._dead.add(peer.instance)
        ch = self._channels.pop(peer.instance, None)
        if ch is not None:
            ch.close()
        self.stats.failovers += 1

    # ------------------------------------------------------------------ calls

    def submit(self, layer: int, hidden: torch.Tensor) -> LayerCall:
        """Send ``layer``'s FFN input; returns at once."""
        began = time.perf_counter()
        call = LayerCall(layer, hidden)
        self._send(call)
        self.stats.calls += 1
        self.stats.submit_seconds += time.perf_counter() - began
        return call

    def _send(self, call: LayerCall) -> None:
        deadline = time.monotonic() + self.config.failover_timeout_s
        while True:
            routes = self.table.route(call.layer, dead=self._dead, prefer=self.prefer)
            if routes is not None:
                parts: list[tuple[Route, FfnChannel, int]] = []
                try:
                    for route in routes:
                        try:
                            ch = self._channel(route.peer)
                            parts.append((route, ch, ch.submit(call.layer, call.hidden)))
                        except ChannelError as exc:
                            self._mark_dead(route.peer, exc)
                            raise
                        except AfdError as exc:  # refused (a mismatched worker): skip it
                            log.error("%s", exc)
                            self._mark_dead(route.peer, exc)
                            raise ChannelError(str(exc)) from exc
                except ChannelError:
                    continue  # re-plan without the dead peer
                call.parts = parts
                self.stats.parts += len(parts)
                return
            self._wait_for_peers(call.layer, deadline)

    def _wait_for_peers(self, layer: int, deadline: float) -> None:
        if time.monotonic() >= deadline:
            msg = (f"no FfnWorker can compute layer {layer} of {self.config.model} "
                   f"within {self.config.failover_timeout_s:g}s: live peers "
                   f"{[p.instance for p in self.config.peers]}, failed {sorted(self._dead)}")
            self._report(EngineFailure(reason=msg, failed=sorted(self._dead)))
            raise AfdUnavailable(msg)
        time.sleep(RETRY_INTERVAL_S)
        self._load()

    def _report(self, failure: EngineFailure) -> None:
        if self.config.error_file:
            try:
                write_failure(Path(self.config.error_file), failure)
            except OSError:
                log.exception("cannot write the AFD error file")

    def collect(self, call: LayerCall) -> torch.Tensor:
        """Block until ``call``'s FFN output is back (failing over as needed)."""
        began = time.perf_counter()
        try:
            while True:
                try:
                    return self._gather(call)
                except ChannelError:
                    self._send(call)  # every part again, on the live workers
        finally:
            self.stats.wait_seconds += time.perf_counter() - began

    def _gather(self, call: LayerCall) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for route, ch, seq in call.parts:
            try:
                out, us = ch.collect(seq)
            except ChannelError as exc:
                self._mark_dead(route.peer, exc)
                raise
            self.stats.worker_compute_us += us
            outs.append(out)
        if len(outs) == 1:
            return outs[0]
        total = outs[0].float()
        for extra in outs[1:]:
            total += extra.float()
        return total.to(self.dtype)

    def close(self) -> None:
        self._closed.set()
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
