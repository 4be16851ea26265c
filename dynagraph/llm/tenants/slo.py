"""SLO classes: what a class of requests is promised, and its scheduling priority."""

from __future__ import annotations

from pydantic import Field

from dynagraph.config import ConfigModel


class SloClass(ConfigModel):
    """One class. ``priority``: vLLM's (lower is served first); targets in milliseconds
    (None: best effort)."""

    priority: int = 0
    ttft_ms: float | None = Field(default=None, gt=0)
    itl_ms: float | None = Field(default=None, gt=0)


def default_slo_classes() -> dict[str, SloClass]:
    return {
        "interactive": SloClass(priority=0, ttft_ms=1000, itl_ms=100),
        "default": SloClass(priority=5),
        "batch": SloClass(priority=10),
    }
