"""The contract between the HTTP app and the serving graph: :class:`Backend`, :class:`ModelInfo`.

The app (``dynagraph.llm.http.app``) only validates and formats; everything
model-specific happens behind :class:`Backend`, which the Frontend component implements
by calling the Processor. Tests pass a fake straight in.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dynagraph.llm.protocol import OpenAIRequest, TextChunk, TokenizeKind
from dynagraph.llm.tenants import TenantToken


@dataclass(frozen=True)
class ModelInfo:
    """A model some live worker serves."""

    name: str
    max_model_len: int | None = None


class Backend(Protocol):
    """What the HTTP app needs from the serving graph (the Frontend implements it)."""

    def ready(self) -> bool:
        """True when at least one model worker can take requests (drives ``/health``)."""
        ...

    def models(self) -> Sequence[ModelInfo]:
        """The models live workers serve now (cheap; called per request)."""
        ...

    async def tokenize(self, kind: TokenizeKind, model: str, body: dict[str, Any]
                       ) -> dict[str, Any]:
        """Answer a ``/tokenize`` (``kind == "tokenize"``) or ``/detokenize`` body."""
        ...

    def generate(self, request: OpenAIRequest, request_id: str,
                 tenant: TenantToken | None = None) -> AsyncIterator[TextChunk]:
        """Stream the response text for one validated request.

        The last chunk has ``finish_reason`` set and the final usage counts. Errors are
        raised from the iterator: ``InvalidRequest``/``PromptTooLong`` become 400,
        ``NoInstancesError`` 503, anything else 500. The app closes the iterator
        (``aclose``) early when the client disconnects, cancelling the request.
        """
        ...
