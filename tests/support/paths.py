"""Where things are, for tests."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "tiny-llama"


@contextlib.contextmanager
def shm_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory on /dev/shm (a tmpfs, as a host-shared KV tier wants), removed
    with everything in it when the block ends."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
