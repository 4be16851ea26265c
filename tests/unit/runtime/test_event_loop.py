"""The component processes' event loop: uvloop by default, asyncio's on request."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from dynagraph.errors import ConfigError
from dynagraph.runtime import event_loop


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_uvloop_by_default_and_asyncio_on_request() -> None:
    assert event_loop.run(_loop_type, {}) is uvloop.Loop
    assert event_loop.run(_loop_type, {"DYNAGRAPH_EVENT_LOOP": " UVLOOP "}) is uvloop.Loop
    plain = event_loop.run(_loop_type, {"DYNAGRAPH_EVENT_LOOP": "asyncio"})
    assert not issubclass(plain, uvloop.Loop)
    assert issubclass(plain, asyncio.BaseEventLoop)


def test_an_unknown_loop_is_refused_naming_the_variable_before_main_runs() -> None:
    called = []

    async def main() -> None:
        called.append(1)

    with pytest.raises(ConfigError, match=r"DYNAGRAPH_EVENT_LOOP='trio': expected one of uvloop, asyncio"):
        event_loop.run(main, {"DYNAGRAPH_EVENT_LOOP": "trio"})
    assert called == []


def test_without_uvloop_it_falls_back_to_asyncio(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert event_loop.loop_factory({}) is None
    assert "uvloop is not installed" in caplog.text
