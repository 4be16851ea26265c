"""The request side of a ``MockerEngine``: which sampling options it refuses, and the
queue through which the step task hands a request's outputs to its ``generate``.

``unsupported`` is pure. ``OutputStream`` is used on one event loop: the step task
calls ``push`` (an output, in order) or ``fail`` (the engine broke); the request's
``generate`` awaits ``get``, which returns the outputs in the order pushed and raises
the failure once none is left.
"""

from __future__ import annotations

import asyncio
from collections import deque

from dynagraph.llm.engines.base import EngineOutput, SamplingSpec


def unsupported(sampling: SamplingSpec) -> str | None:
    """The first sampling option the mocker would have to ignore, or None.

    Options whose effect a client can check (several choices, logprobs, a structured
    output, token constraints) are refused rather than ignored. The distribution's shape
    (temperature, top-p/k, min-p, penalties) has no model to act on: temperature 0
    makes the output depend on the prompt only, the rest changes nothing.
    """
    if sampling.n != 1:
        return "n"
    for name in ("logprobs", "prompt_logprobs", "structured_outputs", "logit_bias",
                 "allowed_token_ids"):
        if getattr(sampling, name) is not None:
            return name
    if sampling.bad_words:
        return "bad_words"
    return None


class OutputStream:
    """One request's outputs, in order, for its ``generate`` iterator."""

    __slots__ = ("error", "items", "waiter")

    def __init__(self) -> None:
        self.items: deque[EngineOutput] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None

    def push(self, item: EngineOutput) -> None:
        self.items.append(item)
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> EngineOutput:
        while not self.items:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()
