"""Typed hops: an endpoint's declared item type reaches its callers' clients, and the
in-memory client (``dynagraph.sdk.testing``) behaves as ``depends()`` does when served."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec
import pytest

from dynagraph.errors import InstanceUnavailable
from dynagraph.sdk import depends, direct, endpoint, instance_ids, service, spec_of
from dynagraph.sdk.testing import in_memory_client
from tests.support.poll import collect


class Ask(msgspec.Struct):
    text: str


class Answer(msgspec.Struct, omit_defaults=True):
    text: str
    score: int = 0


@service(dynamo={"namespace": "t"})
class Echo:
    @endpoint()
    async def generate(self, request: Ask) -> AsyncGenerator[Answer, None]:
        yield Answer(request.text)

    @endpoint()
    async def raw(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        yield request


@service(dynamo={"namespace": "t"})
class Caller:
    echo = depends(Echo)

    async def ask(self, text: str, instance: int | None = None) -> list[Answer]:
        if instance is None:
            return await collect(self.echo.generate(Ask(text)))
        return await collect(direct(self.echo.generate, Ask(text), instance))


def test_the_spec_records_request_and_item_types() -> None:
    eps = {ep.name: ep for ep in spec_of(Echo).endpoints}
    assert (eps["generate"].request_type, eps["generate"].response_type) == (Ask, Answer)
    assert (eps["raw"].request_type, eps["raw"].response_type) == (None, None)


async def test_requests_arrive_as_wire_values_and_items_are_typed() -> None:
    async def generate(request: Any, instance: int) -> AsyncIterator[Any]:
        assert request == {"text": "hi"}  # as the callee's SDK gets it off the wire
        yield {"text": f"{request['text']}@{instance}", "score": instance}

    echo = in_memory_client(Echo, {"generate": generate}, instance_ids=[4, 5])
    caller = Caller(echo=echo)
    assert await caller.ask("hi") == [Answer("hi@4", 4)]
    assert await caller.ask("hi") == [Answer("hi@5", 5)]  # round robin
    assert await caller.ask("hi", instance=5) == [Answer("hi@5", 5)]
    assert instance_ids(caller.echo.generate) == [4, 5]
    assert [(e, i) for e, i, _ in echo.memory.calls] == [
        ("generate", 4), ("generate", 5), ("generate", 5)]


async def test_an_unreachable_instance_is_skipped_before_its_first_item() -> None:
    async def generate(request: Any, instance: int) -> AsyncIterator[Any]:
        if instance == 1:
            raise InstanceUnavailable("down")
        yield {"text": "ok"}

    caller = Caller(echo=in_memory_client(Echo, {"generate": generate}, instance_ids=[1, 2]))
    assert await caller.ask("x") == [Answer("ok")]


async def test_a_struct_item_travels_without_its_defaults() -> None:
    from dynagraph.runtime.rpc import wire_copy

    assert wire_copy(Answer("a")) == {"text": "a"}
    assert wire_copy({"nested": [Answer("b", 2)]}) == {"nested": [{"text": "b", "score": 2}]}
    with pytest.raises(TypeError):
        wire_copy(object())
