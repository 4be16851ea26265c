"""OpenAI-compatible HTTP frontend: ``create_app(backend, served_model_name=...)``."""

from __future__ import annotations

from dynagraph.llm.http.app import create_app
from dynagraph.llm.http.backend import Backend
from dynagraph.llm.http.metrics import FrontendMetrics

__all__ = ["Backend", "FrontendMetrics", "create_app"]
