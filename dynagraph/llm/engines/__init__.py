"""Inference engines behind one protocol (:class:`Engine`).

Importing this package does not import vLLM; use
``from dynagraph.llm.engines.vllm_engine import VllmEngine, VllmEngineArgs``.
"""

from __future__ import annotations

from dynagraph.llm.engines.base import (
    Engine,
    EngineLoad,
    EngineOutput,
    FinishReason,
    SamplingSpec,
)

__all__ = ["Engine", "EngineLoad", "EngineOutput", "FinishReason", "SamplingSpec"]
