from __future__ import annotations

from pathlib import Path

import pytest

from dynagraph.llm.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tok(tiny_tokenizer_dir: Path) -> Tokenizer:
    """The shared tiny tokenizer (``tests/support/tokenizer.py``)."""
    return Tokenizer.from_dir(tiny_tokenizer_dir)
