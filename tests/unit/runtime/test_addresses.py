"""This host's address (``--host``) and the guard against publishing loopback addresses."""

from __future__ import annotations

import pytest

from dynagraph.errors import ConfigError
from dynagraph.runtime.addresses import (
    PublishGuard,
    address_host,
    advertised,
    host_from_env,
    is_loopback,
    loopback_values,
    publish_guard,
    validate_host,
)
from dynagraph.runtime.discovery import MemoryDiscovery, MemoryStore


def test_host_defaults_to_loopback_and_reads_the_environment() -> None:
    assert host_from_env({}) == "127.0.0.1"
    assert host_from_env({"DYNAMO_HOST": " "}) == "127.0.0.1"
    assert host_from_env({"DYNAMO_HOST": " 198.18.0.2 "}) == "198.18.0.2"


@pytest.mark.parametrize(("bad", "why"), [
    ("0.0.0.0", "not 0.0.0.0"), ("node-1", "not an IPv4 address"),
    ("::1", "IPv6 is not supported"), ("224.0.0.1", "not 0.0.0.0"),
    ("198.18.0.300", "not an IPv4 address"),
])
def test_unusable_hosts_are_refused_saying_why(bad: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        validate_host(bad)


def test_bindable_checks_the_address_belongs_to_this_machine() -> None:
    assert validate_host("127.0.0.1", bindable=True) == "127.0.0.1"
    with pytest.raises(ConfigError, match="not an address of this host"):
        validate_host("198.51.100.77", bindable=True)  # TEST-NET-2: never assigned here


@pytest.mark.parametrize(("host", "loop"), [
    ("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("api.localhost", True), ("LOCALHOST", True),
    ("198.18.0.1", False), ("0.0.0.0", False), ("my-host", False),
])
def test_is_loopback(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


@pytest.mark.parametrize(("value", "host"), [
    ("127.0.0.1:4000", "127.0.0.1"), ("http://127.0.0.1:8000", "127.0.0.1"),
    ("tcp://localhost:5557", "localhost"), ("[::1]:80", "::1"), ("198.18.0.3:1", "198.18.0.3"),
    ("localhost", "localhost"), ("127.0.0.1", "127.0.0.1"),
    ("models/tiny-llama", None), ("tiny-llama", None), ("a b:1", None), ("", None),
    ("VllmWorker-1a2b", None),
])
def test_address_host(value: str, host: str | None) -> None:
    assert address_host(value) == host


def test_loopback_values_walks_records_and_names_the_field() -> None:
    record = {"address": "198.18.0.2:4100", "metrics": "127.0.0.1:9000", "pid": 7,
              "host": "node-a", "model_path": "models/tiny-llama",
              "nixl": {"host": "localhost", "port": 5600},
              "endpoints": ["generate", "http://127.0.0.1:8000/v1"]}
    assert list(loopback_values(record)) == [
        ("metrics", "127.0.0.1:9000"), ("nixl.host", "localhost"),
        ("endpoints[1]", "http://127.0.0.1:8000/v1")]
    assert list(loopback_values("127.0.0.1:1")) == [("value", "127.0.0.1:1")]
    assert list(loopback_values({"address": "198.18.0.2:1", "n": None})) == []


def test_guard_only_when_this_host_is_not_loopback() -> None:
    assert publish_guard("127.0.0.1") is None
    guard = publish_guard("198.18.0.2")
    assert isinstance(guard, PublishGuard)
    guard("/ns/instances/A/1", {"address": "198.18.0.2:4000"})
    with pytest.raises(ConfigError) as info:
        guard("/ns/instances/Frontend/1", {"url": "http://127.0.0.1:8000"})
    text = str(info.value)
    assert "/ns/instances/Frontend/1" in text and "url='http://127.0.0.1:8000'" in text
    assert "198.18.0.2" in text and "Frontend.host" in text


async def test_discovery_refuses_to_publish_through_the_guard() -> None:
    disc = MemoryDiscovery(MemoryStore())
    await disc.start()
    try:
        disc.publish_check = PublishGuard("198.18.0.2")
        await disc.register("ns", "A", "generate", "198.18.0.2:4000", {"metrics": "198.18.0.2:1"})
        with pytest.raises(ConfigError, match="loopback"):
            await disc.register("ns", "B", "generate", "127.0.0.1:4000")
        with pytest.raises(ConfigError, match="nixl.host"):
            await disc.put("/ns/x", {"nixl": {"host": "127.0.0.1", "port": 1}}, lease=True)
        assert await disc.get_prefix("/ns/") != {} and await disc.get("/ns/x") is None
        assert len(await disc.get_prefix("/ns/components/B/")) == 0
    finally:
        await disc.close()


def test_a_wildcard_listener_publishes_this_hosts_address() -> None:
    assert advertised("0.0.0.0", {"DYNAMO_HOST": "198.18.0.4"}) == "198.18.0.4"
    assert advertised("0.0.0.0", {}) == "127.0.0.1"
    assert advertised("198.18.0.5", {"DYNAMO_HOST": "198.18.0.4"}) == "198.18.0.5"
    assert advertised("my-host", {}) == "my-host"
