"""Part of a graph per host: ``dynamo serve GRAPH -f CONFIG --service-name NAME ...``.

Each host serves the same graph and config file and starts only the components named
(with their config sections); the others run elsewhere and are found through the shared
etcd. Readiness counts only the instances this ``dynamo serve`` started: every child is
given a serve id (``DYNAMO_SERVE_ID``), published with its instance as ``serve_id``, so
another host's instances of the same component are never mistaken for ours.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dynagraph.errors import ConfigError, GraphError
from dynagraph.runtime.addresses import HOST_ENV, is_loopback
from dynagraph.sdk._config import ComponentConfig, embedded_in
from dynagraph.sdk._graph import Graph

SHARED_INFRA = ("ETCD_ENDPOINTS", "NATS_SERVER")
SERVE_ID_ENV = "DYNAMO_SERVE_ID"
"""Set by ``dynamo serve`` in each child; published with its instance as ``serve_id``."""


def select(graph: Graph, configs: Mapping[str, ComponentConfig],
           names: Sequence[str]) -> dict[str, ComponentConfig]:
    """The configs of the components to start: ``names`` (every component if empty).

    Raises GraphError naming an unknown component and the graph's components.
    """
    known = list(graph.names())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise GraphError(f"--service-name {', '.join(unknown)}: not in the graph "
                         f"(its components: {', '.join(known)})")
    wanted = set(names) or set(known)
    for n in names:
        host = configs[n].service_args.embed_in
        if host is not None and host not in wanted:
            raise GraphError(f"--service-name {n}: it runs inside {host}'s processes "
                             f"(ServiceArgs.embed-in); serve {host} here too")
    wanted |= {guest for host in list(wanted) for guest in embedded_in(configs, host)}
    return {n: configs[n] for n in known if n in wanted}


def is_partial(graph: Graph, names: Sequence[str]) -> bool:
    return bool(names) and set(names) != set(graph.names())


def missing_shared_infra(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The shared-infrastructure variables that are not set."""
    return [v for v in SHARED_INFRA if not environ.get(v)]


def shared_infra_message(missing: Iterable[str]) -> str:
    return (f"--service-name serves part of a graph whose other components run on other "
            f"hosts; all of them must share one etcd and one NATS, but {', '.join(missing)} "
            "is not set. Start etcd and nats-server (JetStream) where every host reaches "
            "them and set ETCD_ENDPOINTS=http://HOST:2379 NATS_SERVER=nats://HOST:4222 on "
            "every host (README, 'Several hosts').")


def own(records: Mapping[str, list[dict[str, Any]]], serve_id: str
        ) -> dict[str, list[dict[str, Any]]]:
    """The instance records this serve started (``serve_id``), per component."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, recs in records.items():
        mine = [r for r in recs if r.get("serve_id") == serve_id]
        if mine:
            out[name] = mine
    return out


def check_hosts(configs: Mapping[str, ComponentConfig], host: str) -> None:
    """Refuse a component ``host`` key on loopback when this host publishes ``host``
    (not loopback): that component would listen where no other host reaches it, and its
    process would refuse to publish the address. Raises ConfigError naming the key."""
    if is_loopback(host):
        return
    for name, cfg in configs.items():
        value = cfg.values.get("host")
        if isinstance(value, str) and is_loopback(value):
            raise ConfigError(
                f"{value!r} is loopback, but this host publishes {host} (--host/{HOST_ENV}); "
                f"set --{name}.host={host} (or 0.0.0.0)", component=name, key="host")
