"""NatsPrefillQueue's stream creation against scripted JetStream answers (no server)."""

from __future__ import annotations

from typing import Any

import pytest
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError

from dynagraph.runtime.queue import NatsPrefillQueue

OVERLAP = BadRequestError(code=400, err_code=10065,
                          description="subjects overlap with an existing stream")
IN_USE = BadRequestError(code=400, err_code=10058, description="stream name already in use")


class ScriptedJetStream:
    def __init__(self, *answers: BaseException | None) -> None:
        self.answers = list(answers)
        self.calls: list[str] = []

    async def add_stream(self, cfg: StreamConfig) -> None:
        self.calls.append("add")
        answer = self.answers.pop(0)
        if answer is not None:
            raise answer

    async def update_stream(self, cfg: StreamConfig) -> None:
        self.calls.append("update")


async def ensure(js: Any) -> None:
    q = NatsPrefillQueue("nats://127.0.0.1:1", "unit")
    await q._ensure_stream(js, StreamConfig(name=q.stream, subjects=[q.subject]))


async def test_a_racing_create_is_retried() -> None:
    js = ScriptedJetStream(OVERLAP, OVERLAP, None)
    await ensure(js)
    assert js.calls == ["add", "add", "add"]


async def test_an_existing_stream_with_other_settings_is_updated() -> None:
    js = ScriptedJetStream(OVERLAP, IN_USE)
    await ensure(js)
    assert js.calls == ["add", "add", "update"]


async def test_a_real_overlap_is_reported_after_the_retries() -> None:
    js = ScriptedJetStream(*[OVERLAP] * 4)
    with pytest.raises(BadRequestError):
        await ensure(js)
    assert js.calls == ["add"] * 4
