"""ETCD_ENDPOINTS parsing and discovery_from_env."""

from __future__ import annotations

import pytest

from dynagraph.errors import ConfigError
from dynagraph.runtime.discovery import EtcdDiscovery, discovery_from_env, parse_endpoints


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://127.0.0.1:2379", [("127.0.0.1", 2379)]),
        ("127.0.0.1:2380", [("127.0.0.1", 2380)]),
        ("http://a:1, b:2 ,", [("a", 1), ("b", 2)]),
        ("localhost", [("localhost", 2379)]),
        ("http://h:12/", [("h", 12)]),
    ],
)
def test_parse_endpoints(text: str, expected: list[tuple[str, int]]) -> None:
    assert parse_endpoints(text) == expected


@pytest.mark.parametrize("text", ["", " , ", "https://h:1", "h:port", ":2379"])
def test_parse_endpoints_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="ETCD_ENDPOINTS"):
        parse_endpoints(text)


def test_discovery_from_env() -> None:
    d = discovery_from_env({"ETCD_ENDPOINTS": "127.0.0.1:4001,http://10.0.0.1:2379"}, lease_ttl=5)
    assert isinstance(d, EtcdDiscovery)
    assert d.endpoints == [("127.0.0.1", 4001), ("10.0.0.1", 2379)]
    assert d.lease_ttl == 5
    assert discovery_from_env({}).endpoints == [("127.0.0.1", 2379)]
    with pytest.raises(ConfigError, match="ETCD_ENDPOINTS"):
        discovery_from_env({"ETCD_ENDPOINTS": "https://x:1"})


def test_lease_ttl_below_etcd_minimum_is_rejected() -> None:
    with pytest.raises(ValueError, match="lease_ttl"):
        EtcdDiscovery(lease_ttl=1)
