"""Processor: OpenAI request in, text chunks out.

Applies the chat template and tokenizes (``Preprocessor``), picks a worker
(``router-mode``: ``round-robin`` or ``random`` among live workers), streams the
worker's token ids back through the incremental detokenizer (stop strings, finish
reason, usage) and yields ``TextChunk``s to the Frontend.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from components.worker import VllmWorker
from dynagraph.llm.detokenize import detokenize_stream
from dynagraph.llm.preprocess import Preprocessor
from dynagraph.llm.protocol import OpenAIRequestEnvelope
from dynagraph.llm.tokenizer import Tokenizer
from dynagraph.sdk import depends, endpoint, service

log = logging.getLogger(__name__)


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class ProcessorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=_kebab, validate_by_name=True,
                              validate_by_alias=True)

    model: str
    """Model directory: the tokenizer and chat template come from here."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length (prompt + completion); longer prompts are refused with 400."""
    router_mode: Literal["round-robin", "random"] = "round-robin"


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class Processor:
    worker = depends(VllmWorker)

    def __init__(self, config: ProcessorConfig) -> None:
        self.config = config
        self.preprocessor = Preprocessor(Tokenizer.from_dir(config.model),
                                         max_model_len=config.max_model_len)

    @endpoint()
    async def generate(self, request: OpenAIRequestEnvelope) -> AsyncIterator[dict[str, Any]]:
        pre = self.preprocessor.preprocess(request.unwrap(), request.request_id)
        detok = self.preprocessor.detokenizer(pre)
        if self.config.router_mode == "random":
            stream = self.worker.random(pre.to_wire())
        else:
            stream = self.worker.generate(pre.to_wire())
        async with contextlib.aclosing(detokenize_stream(detok, stream)) as chunks:
            async for chunk in chunks:
                yield chunk.to_wire()
