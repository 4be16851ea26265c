"""Parsing ``ETCD_ENDPOINTS`` and building a `Discovery` from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from dynagraph.errors import ConfigError

if TYPE_CHECKING:
    from dynagraph.runtime.discovery._etcd import EtcdDiscovery

DEFAULT_ENDPOINT = "http://127.0.0.1:2379"


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """``"http://a:2379,b:2380"`` -> ``[("a", 2379), ("b", 2380)]`` (port defaults to 2379)."""
    out: list[tuple[str, int]] = []
    for item in (p.strip() for p in endpoints.split(",")):
        if not item:
            continue
        if item.startswith("https://"):
            raise ConfigError(f"TLS etcd endpoints are not supported: {item!r}", key="ETCD_ENDPOINTS")
        hostport = item.removeprefix("http://").rstrip("/")
        host, sep, port = hostport.rpartition(":")
        if not sep:
            host, port = hostport, "2379"
        if not host or not port.isdigit():
            raise ConfigError(f"bad etcd endpoint {item!r}; expected [http://]host:port",
                              key="ETCD_ENDPOINTS")
        out.append((host, int(port)))
    if not out:
        raise ConfigError(f"no etcd endpoint in {endpoints!r}", key="ETCD_ENDPOINTS")
    return out


def discovery_from_env(
    environ: Mapping[str, str] | None = None, *, lease_ttl: int = 3
) -> EtcdDiscovery:
    """An (unstarted) EtcdDiscovery on ``ETCD_ENDPOINTS`` (default http://127.0.0.1:2379)."""
    from dynagraph.runtime.discovery._etcd import EtcdDiscovery

    env = os.environ if environ is None else environ
    endpoints = env.get("ETCD_ENDPOINTS", "").strip() or DEFAULT_ENDPOINT
    parse_endpoints(endpoints)  # fail here, with the variable named, not at start()
    return EtcdDiscovery(endpoints, lease_ttl=lease_ttl)
