"""The VllmWorker's side of AFD: find the FfnWorkers, tell the engine, keep it current.

``AfdAttachment`` (built by the VllmWorker when an FfnWorker is linked):

1. ``prepare(args)`` waits until the FfnWorkers registered in etcd (their ``afd``
   metadata) can compute every layer (``RouteTable.missing()``; ``wait-for-workers-s``),
   writes the AFD file (``settings.AfdEngineConfig``) into a private temp directory and
   returns the engine arguments with ``hf_overrides`` naming the AFD architecture and
   the file. It also registers the AFD architectures in this process (the plugin's
   ``register``; the entry point does the same in vLLM's own processes), makes vLLM
   run its model inside the engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
   unless set: one process holds the connector) and lets the engine's OpenMP threads
   sleep instead of spin while it waits for FFN results (``OMP_WAIT_POLICY=PASSIVE``
   unless set).
2. ``follow()`` (a task) rewrites the file whenever the FfnWorker set changes, so the
   connector fails over to replacements and uses new replicas; after the engine gave up
   (no worker for some layer within the failover timeout) it restarts the engine once
   every layer is covered again.
3. ``explain(exc)`` turns an engine failure into the connector's own reason (the error
   file it wrote before giving up), so a caller sees "no FfnWorker can compute layer 2
   ..." rather than vLLM's generic engine-dead message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from dynagraph.errors import EngineError
from dynagraph.llm.afd.errors import AfdUnavailable
from dynagraph.llm.afd.model_info import read_model_info
from dynagraph.llm.afd.models.common import CONFIG_ATTR
from dynagraph.llm.afd.plan import RouteTable
from dynagraph.llm.afd.plugin import AFD_ARCHITECTURE, register
from dynagraph.llm.afd.settings import (
    AfdEngineConfig,
    AfdOptions,
    EngineFailure,
    PeerInfo,
    read_failure,
    write_engine_config,
)
from dynagraph.llm.engines.vllm.args import VllmEngineArgs

log = logging.getLogger(__name__)

POLL_S = 0.25
RESTART_BACKOFF_S = 2.0
RESTART_BACKOFF_MAX_S = 30.0
FAILED_PEER_GRACE_S = 15.0
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
OMP_WAIT_ENV = "OMP_WAIT_POLICY"


def live_peers(instances: list[Any], model: str) -> list[PeerInfo]:
    """The FfnWorkers among discovery ``instances`` that serve ``model`` (pure)."""
    peers = []
    for inst in instances:
        record = (getattr(inst, "metadata", None) or {}).get("afd")
        if not record:
            continue
        try:
            peer = PeerInfo.model_validate(record)
        except ValueError:
            log.warning("ignoring malformed AFD record of instance %s", inst)
            continue
        if peer.model == model:
            peers.append(peer)
    return sorted(peers, key=lambda p: p.instance)


class AfdAttachment:
    """See module doc. ``instances()`` lists the FfnWorker instances (with metadata)."""

    def __init__(self, options: AfdOptions, model_dir: str, instances: Any) -> None:
        self.options = options
        self.info = read_model_info(model_dir)
        self._instances = instances
        self._dir = Path(tempfile.mkdtemp(prefix="dynagraph-afd-"))
        self.path = self._dir / "afd.json"
        self.error_file = self._dir / "error.txt"
        self.stats_file = self._dir / "stats.json"
        self._written: list[PeerInfo] | None = None

    def _config(self, peers: list[PeerInfo]) -> AfdEngineConfig:
        return AfdEngineConfig(model=self.info.name, peers=peers, error_file=str(self.error_file),
                               stats_file=str(self.stats_file), **self.options.model_dump())

    def _peers(self) -> list[PeerInfo]:
        return live_peers(self._instances(), self.info.name)

    def _write(self, peers: list[PeerInfo]) -> None:
        if peers != self._written:
            write_engine_config(self.path, self._config(peers))
            self._written = peers

    def missing(self, peers: list[PeerInfo]) -> list[int]:
        return RouteTable(peers, num_layers=self.info.num_layers,
                          num_experts=self.info.num_experts).missing()

    async def prepare(self, args: VllmEngineArgs) -> VllmEngineArgs:
        """Wait for FfnWorkers covering every layer, write the AFD file, and return the
        engine arguments that select the AFD model (see module doc)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.wait_for_workers_s
        while True:
            peers = self._peers()
            missing = self.missing(peers)
            if not missing:
                break
            if loop.time() >= deadline:
                raise AfdUnavailable(
                    f"no FfnWorkers for layers {missing} of {self.info.name} after "
                    f"{self.options.wait_for_workers_s:g}s (have {len(peers)} workers: "
                    f"{[(p.layers, p.experts) for p in peers]})")
            await asyncio.sleep(POLL_S)
        self._write(peers)
        log.info("AFD: %d FfnWorkers cover the %d layers of %s", len(peers),
                 self.info.num_layers, self.info.name)
        register()
        os.environ.setdefault(IN_PROCESS_ENV, "0")
        # The engine waits in a socket for every layer's FFN; with OpenMP's default wait
        # policy its idle threads spin meanwhile, taking the CPU an FfnWorker on the same
        # cores needs: 9 vs 740 tokens/s in one measurement here (benchmarks/afd.py).
        os.environ.setdefault(OMP_WAIT_ENV, "PASSIVE")
        extra = dict(args.extra_engine_args)
        overrides = dict(extra.get("hf_overrides") or {})
        overrides.update({"architectures": [AFD_ARCHITECTURE[self.info.arch]],
                          CONFIG_ATTR: str(self.path)})
        extra["hf_overrides"] = overrides
        # With vLLM's iteration-details logging on (VllmEngine turns it on to time steps for
        # the Router's learned speeds) no forward pass was split into micro-batches
        # (tests/e2e_afd: 0 of 128 forwards); an AFD engine's steps go untimed instead.
        extra.setdefault("enable_logging_iteration_details", False)
        return args.model_copy(update={"extra_engine_args": extra})

    async def follow(self, restart: Callable[[], Awaitable[None]] | None = None) -> None:
        """Keep the AFD file current with etcd until cancelled.

        When the engine gave up (the connector left its ``EngineFailure``: the engine
        is dead) and FfnWorkers other than the ones it found dead cover every layer
        again, ``restart()`` (the VllmWorker's engine restart) runs and the failure is
        cleared; until then requests fail with its reason. A dead worker's etcd record
        outlives it by its lease, so it does not count for ``FAILED_PEER_GRACE_S`` (then
        it does: it may have been slow, not dead). A restart that fails (its warm-up
        found another dead worker, say) is logged and tried again later, no sooner than
        ``RESTART_BACKOFF_S`` after the last, doubling up to ``_MAX_S``."""
        loop = asyncio.get_running_loop()
        backoff, not_before = RESTART_BACKOFF_S, 0.0
        last: EngineFailure | None = None
        seen_at = 0.0
        while True:
            await asyncio.sleep(POLL_S)
            peers = self._peers()
            if peers != self._written:
                log.info("AFD: FfnWorkers now %s", [p.instance for p in peers])
                self._write(peers)
            if restart is None or loop.time() < not_before:
                continue
            failure = self.failure()
            if failure is None:
                continue
            if failure != last:
                last, seen_at = failure, loop.time()
            failed = set(failure.failed) if loop.time() - seen_at < FAILED_PEER_GRACE_S \
                else set()
            if self.missing([p for p in peers if p.instance not in failed]):
                continue
            log.warning("AFD: every layer has FfnWorkers again; restarting the engine")
            try:  # callers meanwhile get the failure's reason (the engine is down)
                await restart()
            except Exception as exc:  # the new engine's connector may have left a new one
                log.warning("AFD: the engine restart failed (%s); trying again in %.0fs "
                            "at the earliest", exc, backoff)
                not_before = loop.time() + backoff
                backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
                continue
            self.error_file.unlink(missing_ok=True)
            backoff = RESTART_BACKOFF_S
            log.info("AFD: engine restarted")

    def failure(self) -> EngineFailure | None:
        """Why the engine gave up, while it is down; None while it is serving."""
        if not self.error_file.exists():
            return None
        return read_failure(self.error_file) or EngineFailure(
            reason=f"the AFD error file {self.error_file} is unreadable")

    def explain(self, exc: BaseException) -> BaseException:
        """The connector's reason for an engine failure, if it left one."""
        failure = self.failure()
        if failure is None:
            return exc
        return EngineError(f"attention-FFN disaggregation failed: {failure.reason}")

    def stats(self) -> dict[str, float]:
        """The engine's latest ``ExchangeStats`` (empty before its first forward pass)."""
        try:
            data = json.loads(self.stats_file.read_text())
        except (OSError, ValueError):
            return {}
        return {k: float(v) for k, v in data.items() if isinstance(v, int | float)}

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
