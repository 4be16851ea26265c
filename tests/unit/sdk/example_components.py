"""Small components used by the SDK unit tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field

from dynagraph.sdk import async_on_start, depends, endpoint, service


class Numbers(BaseModel):
    n: int = Field(ge=0)


class BackConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    scale: int = 1
    label: str = Field(default="back", alias="label-text")


@service(dynamo={"namespace": "test"}, workers=2)
class Back:
    def __init__(self, config: BackConfig) -> None:
        self.config = config
        self.started = False

    @async_on_start
    async def start(self) -> None:
        self.started = True

    @endpoint()
    async def generate(self, request: Numbers) -> AsyncIterator[int]:
        for i in range(request.n):
            yield i * self.config.scale


@service(dynamo={"namespace": "test"})
class Extra:
    @endpoint()
    async def generate(self, request: Numbers) -> AsyncIterator[int]:
        yield -1


@service(dynamo={"namespace": "test"})
class Middle:
    back = depends(Back)
    extra = depends(Extra)

    @endpoint()
    async def generate(self, request: Numbers) -> AsyncIterator[int]:
        async for x in self.back.generate(request):
            yield x + 1


@service(dynamo={"namespace": "test"})
class Front:
    middle = depends(Middle)

    @endpoint(name="stream")
    async def run(self, request: dict) -> AsyncIterator[int]:
        async for x in self.middle.generate(request):
            yield x


pipeline = Front.link(Middle).link(Back)
