"""One :class:`Preprocessor` (and logprob token texts) per served model, built on demand.

The Processor serves every model its workers publish (``dynagraph.llm.models``). The
tokenizer of the configured model directory is loaded at start; another model's is
loaded from the ``model_path`` its workers publish the first time a request names it
(off the event loop), then kept. A preprocessor is rebuilt when the model's published
limits change (context length, logprobs, structured outputs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass

from dynagraph.errors import ConfigError, InvalidRequest
from dynagraph.llm.api.logprobs import TokenTexts
from dynagraph.llm.models import ServedModel
from dynagraph.llm.preprocess import Preprocessor
from dynagraph.llm.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelContext:
    preprocessor: Preprocessor
    texts: TokenTexts
    model: ServedModel


class PreprocessorCache:
    """Preprocessors by served model. ``default_path`` is loaded in the constructor."""

    def __init__(self, default_path: str, *, max_model_len: int | None = None,
                 tool_parser: str | None = None, chat_template: str | None = None) -> None:
        self.default_path = _resolved(default_path)
        self._max_model_len = max_model_len
        self._tool_parser = tool_parser
        self._chat_template = chat_template
        tokenizer = Tokenizer.from_dir(default_path)
        self._tokenizers: dict[str, tuple[Tokenizer, TokenTexts]] = {
            self.default_path: (tokenizer, TokenTexts(tokenizer.backend))}
        self._contexts: dict[tuple[object, ...], ModelContext] = {}
        self._lock = asyncio.Lock()

    @property
    def default_tokenizer(self) -> Tokenizer:
        return self._tokenizers[self.default_path][0]

    async def get(self, model: ServedModel) -> ModelContext:
        """The context for ``model``; raises InvalidRequest if its tokenizer cannot load."""
        path = _resolved(model.path) if model.path else self.default_path
        max_len = model.max_model_len if model.max_model_len is not None else (
            self._max_model_len if path == self.default_path else None)
        key = (model.name, path, max_len, model.max_logprobs, model.structured_outputs)
        ctx = self._contexts.get(key)
        if ctx is None:
            tokenizer, texts = await self._tokenizer(path, model.name)
            pre = Preprocessor(tokenizer, max_model_len=max_len,
                               max_logprobs=model.max_logprobs,
                               structured_outputs=model.structured_outputs,
                               tool_parser=self._tool_parser, chat_template=self._chat_template)
            ctx = self._contexts[key] = ModelContext(pre, texts, model)
        if ctx.model != model:  # same preprocessor; the live workers of the model changed
            ctx = self._contexts[key] = dataclasses.replace(ctx, model=model)
        return ctx

    async def _tokenizer(self, path: str, name: str) -> tuple[Tokenizer, TokenTexts]:
        found = self._tokenizers.get(path)
        if found is not None:
            return found
        async with self._lock:
            found = self._tokenizers.get(path)
            if found is None:
                try:
                    tokenizer = await asyncio.to_thread(Tokenizer.from_dir, path)
                except ConfigError as exc:
                    raise InvalidRequest(f"cannot load the tokenizer of model {name!r}: {exc}",
                                         param="model") from exc
                log.info("loaded the tokenizer of model %s from %s", name, path)
                found = self._tokenizers[path] = (tokenizer, TokenTexts(tokenizer.backend))
        return found




def _resolved(path: str) -> str:
    """An absolute path (string only: no file-system access on the event loop)."""
    return os.path.normpath(os.path.join(os.getcwd(), path))
