"""This host's address (``--host`` / ``DYNAMO_HOST``) and the check that nothing published
in discovery is a loopback address when the graph spans hosts.

Every listener a peer on another host must reach binds ``DYNAMO_HOST`` and publishes it:
the request plane (``RpcServer``), the metrics server, the NIXL side channel
(``VLLM_NIXL_SIDE_CHANNEL_HOST``). The default, 127.0.0.1, keeps a graph on one machine.
What only the same host uses stays on loopback: the KV-event relay (vLLM's engine core,
a child of the worker, connects to it; the Router reads the events over the request
plane), local etcd/NATS started by ``dynamo serve`` for a single-host graph.

``--host`` is an IPv4 address assigned to this host (not 0.0.0.0: peers must be able to
connect to what is published). When it is not a loopback address, :class:`PublishGuard`
refuses any value written to discovery that names a loopback address: a peer on another
host would connect to itself.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from dynagraph.errors import ConfigError

HOST_ENV = "DYNAMO_HOST"
DEFAULT_HOST = "127.0.0.1"


def validate_host(host: str, *, bindable: bool = False) -> str:
    """``host`` if it is a usable ``--host`` value, else a ConfigError saying why.

    ``bindable`` also checks that the address belongs to this machine (a socket binds it).
    """
    what = f"--host/{HOST_ENV} {host!r}"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"{what} is not an IPv4 address; give the address of this host "
                          "that the other hosts reach (e.g. 10.1.2.3)") from None
    if ip.version != 4:
        raise ConfigError(f"{what}: IPv6 is not supported yet; give an IPv4 address")
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise ConfigError(f"{what} cannot be published: peers connect to the address given "
                          "here; give this host's own address (not 0.0.0.0)")
    if bindable:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, 0))
            except OSError as exc:
                raise ConfigError(f"{what} is not an address of this host ({exc.strerror}); "
                                  "see `ip -4 addr`") from None
    return host


def host_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """``DYNAMO_HOST`` (validated), or 127.0.0.1 when unset or empty."""
    raw = environ.get(HOST_ENV, "").strip()
    return validate_host(raw) if raw else DEFAULT_HOST


def is_loopback(host: str) -> bool:
    """True for loopback IP literals (127.0.0.0/8, ::1) and ``localhost`` names.

    Hostnames are not resolved: a record's ``host`` field (the machine's name) is a
    label, and Debian maps its own hostname to 127.0.1.1."""
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def advertised(bind_host: str, environ: Mapping[str, str] = os.environ) -> str:
    """The host to publish for a listener bound on ``bind_host``: this host's address
    (``DYNAMO_HOST``) for a wildcard bind (0.0.0.0), else ``bind_host`` itself."""
    try:
        wildcard = ipaddress.ip_address(bind_host).is_unspecified
    except ValueError:
        wildcard = False
    return host_from_env(environ) if wildcard else bind_host


def address_host(value: str) -> str | None:
    """The host part of an address-like string: ``scheme://host:port/...``, ``host:port``
    or a bare IP literal / ``localhost``; None when ``value`` does not look like one."""
    text = value.strip()
    if not text or any(c.isspace() for c in text):
        return None
    if "://" in text:
        try:
            return urlsplit(text).hostname
        except ValueError:
            return None
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and host:
        return host.strip("[]")
    if is_loopback(text):
        return text
    return None


def loopback_values(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """``(path, string)`` of every string inside ``value`` (dicts, lists) that names a
    loopback address; ``path`` is dotted (``nixl.host``, ``endpoints[0]``)."""
    if isinstance(value, str):
        host = address_host(value)
        if host is not None and is_loopback(host):
            yield path or "value", value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from loopback_values(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from loopback_values(v, f"{path}[{i}]")


class PublishGuard:
    """Refuses to publish loopback addresses when this host's address is ``host``.

    Installed on a process's discovery (``discovery.publish_check``) by the component
    process when ``DYNAMO_HOST`` is not a loopback address; called with every key and
    value the process writes.
    """

    def __init__(self, host: str) -> None:
        self.host = host

    def __call__(self, key: str, value: Any) -> None:
        bad = list(loopback_values(value))
        if bad:
            fields = ", ".join(f"{p}={v!r}" for p, v in bad)
            raise ConfigError(
                f"refusing to publish {key}: {fields} is a loopback address, which other "
                f"hosts cannot reach (this host publishes {self.host}, from --host/{HOST_ENV}); "
                "bind it on that address (a Frontend: Frontend.host, or 0.0.0.0)")


def publish_guard(host: str) -> PublishGuard | None:
    """The guard for this host's address: None on loopback (a one-machine graph)."""
    return None if is_loopback(host) else PublishGuard(host)


def host_id() -> str:
    """This machine's boot id: equal on both sides of a same-host connection (processes
    in network namespaces of one host share it, and its /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return socket.gethostname()
