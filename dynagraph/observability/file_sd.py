"""Prometheus ``file_sd`` targets kept current from discovery's instance records.

Every component process publishes ``/{namespace}/instances/{component}/{id:x}`` with
``"metrics": "127.0.0.1:PORT"`` (see ``dynagraph.sdk._context.process_key``).
``targets_from_records`` turns those records into a file_sd target list (pure);
``FileSdWriter`` watches the records and rewrites the file (atomically, only when
it changed) so Prometheus scrapes every process of a running graph, including ones
added by scaling, without a config edit. Target labels::

    job="dynagraph" namespace=... component=... instance_id=<hex> worker_index=<n>
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)

JOB = "dynagraph"
TargetGroup = dict[str, Any]


class PrefixWatcher(Protocol):
    """The part of ``dynagraph.runtime.discovery`` this module uses."""

    async def get_prefix(self, prefix: str) -> dict[str, Any]: ...

    def watch_prefix(self, prefix: str) -> Any: ...


def instances_prefix(namespace: str) -> str:
    return f"/{namespace}/instances/"


def targets_from_records(records: Mapping[str, Any],
                         static: Iterable[TargetGroup] = ()) -> list[TargetGroup]:
    """file_sd groups, one per process that publishes a metrics address (the first of its
    instances in sort order labels it), sorted.

    ``records`` maps instance keys to their JSON values; keys that are not
    instance records, and records without ``metrics``, are ignored.
    """
    groups: list[TargetGroup] = []
    for key, rec in records.items():
        parts = key.split("/")
        if len(parts) != 5 or parts[2] != "instances" or not isinstance(rec, Mapping):
            continue
        address = rec.get("metrics")
        if not address:
            continue
        labels = {"job": JOB, "namespace": parts[1], "component": parts[3],
                  "instance_id": parts[4]}
        if rec.get("worker_index") is not None:
            labels["worker_index"] = str(rec["worker_index"])
        groups.append({"targets": [str(address)], "labels": labels})
    groups.sort(key=lambda g: (g["labels"]["namespace"], g["labels"]["component"],
                               g["labels"].get("worker_index", ""), g["labels"]["instance_id"]))
    # One group per address: instances that share a process (an embedded component, or
    # several engines per process) share its metrics server, and scraping it once per
    # instance would count every series that many times. The first in order names it.
    by_address: dict[str, TargetGroup] = {}
    for g in groups:
        by_address.setdefault(g["targets"][0], g)
    unique = list(by_address.values())
    return [*sorted(static, key=lambda g: json.dumps(g, sort_keys=True)), *unique]


def static_target(address: str, job: str, **labels: str) -> TargetGroup:
    """A fixed target (etcd, the NATS exporter) to list next to the graph's processes."""
    return {"targets": [address], "labels": {"job": job, **labels}}


def write_atomically(path: str, groups: list[TargetGroup]) -> bool:
    """Write ``groups`` as JSON to ``path`` via rename; False if the content is unchanged."""
    text = json.dumps(groups, indent=2, sort_keys=True) + "\n"
    with contextlib.suppress(OSError), open(path) as f:
        if f.read() == text:
            return False
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".targets-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return True


class FileSdWriter:
    """Keeps ``path`` equal to ``targets_from_records`` of the live instance records.

    ``start()`` returns once the file holds every record present at that moment;
    ``close()`` stops watching and leaves only the static targets in the file (the
    graph is gone, so Prometheus drops its processes).
    """

    def __init__(self, discovery: PrefixWatcher, namespaces: Iterable[str], path: str,
                 static: Iterable[TargetGroup] = ()) -> None:
        self.discovery = discovery
        self.namespaces = sorted(set(namespaces))
        self.path = path
        self.static = list(static)
        self.records: dict[str, Any] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None

    async def start(self, read_timeout: float = 5.0) -> None:
        for ns in self.namespaces:
            self.records.update(
                await asyncio.wait_for(self.discovery.get_prefix(instances_prefix(ns)), read_timeout))
        self._flush()
        for ns in self.namespaces:
            self._tasks.append(asyncio.create_task(self._watch(instances_prefix(ns))))
        self._writer = asyncio.create_task(self._write_loop())

    async def _watch(self, prefix: str) -> None:
        async for key, value in self.discovery.watch_prefix(prefix):
            if value is None:
                self.records.pop(key, None)
            else:
                self.records[key] = value
            self._changed.set()

    async def _write_loop(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            self._flush()

    def _flush(self) -> None:
        try:
            if write_atomically(self.path, targets_from_records(self.records, self.static)):
                log.debug("wrote %d instance targets to %s", len(self.records), self.path)
        except OSError as exc:
            log.warning("could not write Prometheus targets to %s: %s", self.path, exc)

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._writer] if self._writer else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(t, 2)
        self._tasks.clear()
        self._writer = None
        self.records.clear()
        self._flush()
