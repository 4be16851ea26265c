"""Where things are, for tests."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "tiny-llama"
