"""Where a component process serves its metrics: a free port on ``DYNAMO_HOST`` (default
127.0.0.1), a fixed one with ``DYNAMO_METRICS_PORT`` (what the Kubernetes pods set)."""

from __future__ import annotations

import pytest

from dynagraph.cli.child import metrics_bind
from dynagraph.errors import ConfigError


def test_default_is_a_free_port_on_this_hosts_address() -> None:
    assert metrics_bind({}) == ("127.0.0.1", 0)
    assert metrics_bind({"DYNAMO_HOST": "10.0.0.7"}) == ("10.0.0.7", 0)
    assert metrics_bind({"DYNAMO_METRICS_PORT": " "}) == ("127.0.0.1", 0)


def test_a_bad_host_is_refused() -> None:
    with pytest.raises(ConfigError, match="not 0.0.0.0"):
        metrics_bind({"DYNAMO_HOST": "0.0.0.0"})


def test_fixed_port_on_the_advertised_host() -> None:
    assert metrics_bind({"DYNAMO_METRICS_PORT": "9090"}) == ("127.0.0.1", 9090)
    assert metrics_bind({"DYNAMO_METRICS_PORT": "9090", "DYNAMO_HOST": "10.0.0.7"}) == (
        "10.0.0.7", 9090)


@pytest.mark.parametrize("bad", ["http", "0", "65536", "-1", "90.5"])
def test_bad_port_names_the_variable(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        metrics_bind({"DYNAMO_METRICS_PORT": bad})
    assert info.value.key == "DYNAMO_METRICS_PORT" and repr(bad) in str(info.value)
