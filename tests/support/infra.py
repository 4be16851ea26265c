"""A private etcd and NATS for a test package whose graph must not share a namespace."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dynagraph.runtime.infra import LocalService, start_etcd, start_nats


@contextlib.contextmanager
def own_infra() -> Iterator[tuple[LocalService, LocalService]]:
    """A fresh etcd and nats-server (JetStream), stopped when the block ends."""
    etcd = start_etcd()
    try:
        nats = start_nats()
        try:
            yield etcd, nats
        finally:
            nats.stop()
    finally:
        etcd.stop()
