"""Inference engines behind one protocol (:class:`Engine`).

Importing this package does not import vLLM; use
``dynagraph.llm.engines.vllm`` (``engine.VllmEngine``, ``args.VllmEngineArgs``).
:class:`EchoEngine` is the in-memory engine for unit tests.
"""

from __future__ import annotations

from dynagraph.llm.engines.base import (
    Engine,
    EngineLoad,
    EngineOutput,
    FinishReason,
    SamplingSpec,
)
from dynagraph.llm.engines.echo import EchoEngine

__all__ = ["EchoEngine", "Engine", "EngineLoad", "EngineOutput", "FinishReason", "SamplingSpec"]
