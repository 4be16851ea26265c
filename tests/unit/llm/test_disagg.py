"""The disaggregation policy and its live thresholds."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from dynagraph.llm.disagg.policy import (
    LIVE_KEYS,
    DisaggConfig,
    LiveDisaggSettings,
    PrefillDecision,
    decide_prefill,
    settings_key,
    settings_prefix,
)

ON = DisaggConfig.model_validate({
    "remote-prefill": True, "conditional-disagg": True,
    "max-local-prefill-length": 100, "max-prefill-queue-size": 2,
})


def test_config_kebab_keys_defaults_and_unknown_keys() -> None:
    cfg = DisaggConfig.model_validate({"remote-prefill": True, "remote-prefill-timeout": 2.5})
    assert cfg.remote_prefill and cfg.conditional_disagg
    assert (cfg.max_local_prefill_length, cfg.max_prefill_queue_size) == (1000, 2)
    assert cfg.remote_prefill_timeout == 2.5
    assert DisaggConfig(max_prefill_queue_size=5).max_prefill_queue_size == 5
    with pytest.raises(ValidationError):
        DisaggConfig.model_validate({"max-local-prefil-length": 3})
    with pytest.raises(ValidationError):
        DisaggConfig.model_validate({"max-prefill-queue-size": -1})
    with pytest.raises(ValidationError):
        DisaggConfig.model_validate({"remote-prefill-timeout": 0})


@pytest.mark.parametrize(
    ("prompt", "cached", "depth", "expected"),
    [
        (101, 0, 0, PrefillDecision(True, "long-prompt", 101)),
        (100, 0, 0, PrefillDecision(False, "short-prompt", 100)),  # not over the threshold
        (300, 200, 0, PrefillDecision(False, "short-prompt", 100)),  # cached part does not count
        (301, 200, 1, PrefillDecision(True, "long-prompt", 101)),
        (500, 0, 2, PrefillDecision(False, "queue-full", 500)),  # depth must be under the max
        (500, 0, 9, PrefillDecision(False, "queue-full", 500)),
        (0, 0, 0, PrefillDecision(False, "short-prompt", 0)),
    ],
)
def test_conditional_decision(prompt: int, cached: int, depth: int, expected: PrefillDecision) -> None:
    assert decide_prefill(ON, prompt, cached, depth) == expected


def test_remote_off_and_unconditional() -> None:
    off = ON.model_copy(update={"remote_prefill": False})
    assert decide_prefill(off, 5000, 0, 0) == PrefillDecision(False, "remote-prefill-off", 5000)
    always = ON.model_copy(update={"conditional_disagg": False})
    assert decide_prefill(always, 3, 0, 99) == PrefillDecision(True, "unconditional", 3)


def test_zero_queue_size_means_never_remote() -> None:
    cfg = ON.model_copy(update={"max_prefill_queue_size": 0})
    assert decide_prefill(cfg, 5000, 0, 0).reason == "queue-full"


@pytest.mark.parametrize(("prompt", "cached", "depth"), [(-1, 0, 0), (5, 6, 0), (5, -1, 0), (5, 0, -1)])
def test_bad_inputs_raise(prompt: int, cached: int, depth: int) -> None:
    with pytest.raises(ValueError):
        decide_prefill(ON, prompt, cached, depth)


def test_keys() -> None:
    assert settings_prefix("dynamo") == "/dynamo/settings/VllmWorker/"
    assert settings_key("dynamo", "max-prefill-queue-size") == (
        "/dynamo/settings/VllmWorker/max-prefill-queue-size"
    )
    assert settings_key("ns", "max-local-prefill-length", component="W") == (
        "/ns/settings/W/max-local-prefill-length"
    )
    with pytest.raises(ValueError):
        settings_key("dynamo", "remote-prefill")
    assert set(LIVE_KEYS) == {"max-local-prefill-length", "max-prefill-queue-size"}


def live() -> LiveDisaggSettings:
    return LiveDisaggSettings(ON, namespace="dynamo")


K_LEN = "/dynamo/settings/VllmWorker/max-local-prefill-length"
K_Q = "/dynamo/settings/VllmWorker/max-prefill-queue-size"


@pytest.mark.parametrize("value", [500, "500", b"500", b" 500\n", 500.0])
def test_live_update_accepts_int_forms(value: Any) -> None:
    s = live()
    assert s.apply(K_LEN, value) is True
    assert s.current.max_local_prefill_length == 500
    assert s.apply(K_LEN, 500) is False  # no change
    assert s.decide(400, 0, 0).remote is False
    assert s.decide(501, 0, 0).remote is True


@pytest.mark.parametrize("value", [-1, "abc", b"\xff", 1.5, True, {"a": 1}, [3], "1e3"])
def test_live_update_rejects_bad_values(value: Any, caplog: pytest.LogCaptureFixture) -> None:
    s = live()
    with caplog.at_level(logging.WARNING, logger="dynagraph.runtime.live_settings"):
        assert s.apply(K_Q, value) is False
    assert s.current == ON
    assert "ignoring bad value" in caplog.text


def test_live_delete_reverts_to_config_value() -> None:
    s = live()
    assert s.apply(K_Q, 7)
    assert s.current.max_prefill_queue_size == 7
    assert s.apply(K_Q, None)
    assert s.current.max_prefill_queue_size == 2
    assert s.apply(K_Q, None) is False


def test_live_ignores_other_keys() -> None:
    s = live()
    assert s.apply("/dynamo/settings/VllmWorker/remote-prefill", "false") is False
    assert s.apply("/other/settings/VllmWorker/max-prefill-queue-size", 9) is False
    assert s.apply("/dynamo/settings/PrefillWorker/max-prefill-queue-size", 9) is False
    assert s.current == ON


async def test_follow_applies_a_watch_stream() -> None:
    s = live()

    async def watch() -> AsyncIterator[tuple[str, Any | None]]:
        yield (K_Q, b"0")
        yield (K_LEN, "bad")
        yield (K_LEN, b"10")

    await s.follow(watch())
    assert (s.current.max_prefill_queue_size, s.current.max_local_prefill_length) == (0, 10)
    assert s.decide(50, 0, 0) == PrefillDecision(False, "queue-full", 50)
    assert s.base == ON
