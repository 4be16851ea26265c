"""Start-up progress of a component process, for ``dynamo serve`` to show.

    progress.report("loading", "vLLM engine for models/tiny-llama", label="VllmWorker[0]")

Under ``dynamo serve`` (``DYN_PROGRESS=1`` in the environment, set by the supervisor)
an event is one line on stderr, `MARKER` followed by JSON, which the supervisor turns
into its own progress line (`dynagraph.cli.startup`). Anywhere else it is an INFO log
line, so a component started by hand (or in Kubernetes) logs the same steps.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ENV = "DYN_PROGRESS"
MARKER = "@@dynagraph-progress "

PHASES = ("loading", "ready")
"""``loading``: a slow start-up step began (or made progress); ``ready``: the instance is
registered and serving (its last start-up event)."""


@dataclass(frozen=True)
class Event:
    """One start-up step of one component process."""

    phase: str
    detail: str = ""
    fields: dict[str, Any] = field(default_factory=dict)

    def to_line(self) -> str:
        return MARKER + json.dumps({"phase": self.phase, "detail": self.detail, **self.fields},
                                   separators=(",", ":"))


def parse(line: str) -> Event | None:
    """The event on a line of a child's output (trailing newline allowed), or None."""
    if not line.startswith(MARKER):
        return None
    try:
        data = json.loads(line[len(MARKER):])
        phase = str(data.pop("phase"))
        detail = str(data.pop("detail", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return Event(phase, detail, data)


def report(phase: str, detail: str = "", *, label: str = "", **fields: Any) -> None:
    """Tell ``dynamo serve`` (or the log) that this process reached ``phase``."""
    if phase not in PHASES:
        raise ValueError(f"unknown progress phase {phase!r}; use one of {PHASES}")
    if os.environ.get(ENV) != "1":
        log.info("%s%s%s", f"{label} " if label else "", phase, f": {detail}" if detail else "")
        return
    try:
        sys.stderr.write(Event(phase, detail, fields).to_line() + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # the supervisor's pipe is gone; nothing to tell
        pass
