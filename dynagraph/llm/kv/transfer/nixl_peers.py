"""Where the NIXL agents of a namespace are: the records each NIXL engine publishes under
its lease (``/{namespace}/nixl/{component}/{instance_id:x}``, see ``nixl_side``).

A decode worker that receives a prefill engine's ``kv_transfer_params`` takes the side
channel (host and port) from the prefill *instance's* record, not from the params: the
record is what that instance published for its peers (its ``--host`` address, checked
not to be loopback when the graph spans hosts), and a record that is gone means the
instance is gone. The params' engine id must match the record's.

:class:`NixlPeers` mirrors the records (one etcd watch) and falls back to a read when a
record it has not seen yet is asked for (a hand-off may arrive before the watch event).
:func:`peer_params` is the pure part.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from dynagraph.aio import cancel_and_wait
from dynagraph.llm.kv.transfer.nixl_side import NixlEndpoint

log = logging.getLogger(__name__)


class NixlPeerError(ValueError):
    """A prefill engine's transfer parameters do not match its instance's NIXL record."""


def nixl_prefix(namespace: str) -> str:
    return f"/{namespace}/nixl/"


def instance_of(key: str) -> int | None:
    """The instance id at the end of a NIXL record's key (None if it is not one)."""
    try:
        return int(key.rsplit("/", 1)[1], 16)
    except (IndexError, ValueError):
        return None


def endpoint_of(record: Any) -> NixlEndpoint | None:
    """A record as published (``NixlEndpoint.record()``); None if malformed."""
    if not isinstance(record, dict):
        return None
    try:
        return NixlEndpoint(engine_id=str(record["engine_id"]), host=str(record["host"]),
                            port=int(record["port"]), role=record["role"])
    except (KeyError, TypeError, ValueError):
        return None


def peer_params(params: dict[str, Any], peer: NixlEndpoint) -> dict[str, Any]:
    """``params`` (vLLM NixlConnector ``kv_transfer_params``) with ``peer``'s side channel.

    Raises :class:`NixlPeerError` when the params name another engine than ``peer``.
    """
    engine = params.get("remote_engine_id")
    if engine != peer.engine_id:
        raise NixlPeerError(f"transfer parameters name engine {engine!r}, but the instance's "
                            f"NIXL record is engine {peer.engine_id!r}")
    return {**params, "remote_host": peer.host, "remote_port": peer.port}


class NixlPeers:
    """The NIXL records of ``namespace``, followed live. ``start()``, ``resolve()``,
    ``close()``; single event loop."""

    def __init__(self, discovery: Any, namespace: str) -> None:
        self.discovery = discovery
        self.prefix = nixl_prefix(namespace)
        self.peers: dict[int, NixlEndpoint] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="nixl-peers")

    async def _follow(self) -> None:
        async for key, value in self.discovery.watch_prefix(self.prefix):
            self.apply(key, value)

    def apply(self, key: str, value: Any | None) -> None:
        iid = instance_of(key)
        if iid is None:
            return
        peer = endpoint_of(value) if value is not None else None
        if peer is None:
            self.peers.pop(iid, None)
        else:
            self.peers[iid] = peer

    async def lookup(self, instance_id: int) -> NixlEndpoint | None:
        """The NIXL endpoint ``instance_id`` published, or None if it has none (gone)."""
        peer = self.peers.get(instance_id)
        if peer is not None:
            return peer
        for key, value in (await self.discovery.get_prefix(self.prefix)).items():
            if instance_of(key) == instance_id and (peer := endpoint_of(value)) is not None:
                return peer
        return None

    async def resolve(self, instance_id: int, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` pointed at ``instance_id``'s published side channel.

        Raises :class:`NixlPeerError` when the instance has no record (it is gone) or
        the params name another engine.
        """
        peer = await self.lookup(instance_id)
        if peer is None:
            raise NixlPeerError(f"instance {instance_id:x} has no NIXL record under "
                                f"{self.prefix} (gone?)")
        return peer_params(params, peer)

    async def close(self) -> None:
        if self._task is not None:
            with contextlib.suppress(Exception):
                await cancel_and_wait([self._task])
            self._task = None
