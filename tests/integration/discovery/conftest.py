"""An etcd of this folder's own, for tests that restart or compact it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dynagraph.runtime.infra import LocalService, start_etcd


@pytest.fixture
def own_etcd() -> Iterator[LocalService]:
    svc = start_etcd()
    try:
        yield svc
    finally:
        svc.stop()
