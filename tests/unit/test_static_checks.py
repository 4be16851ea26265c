"""ruff and mypy --strict over the project, as part of the fast set (and of .ci/run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.paths import REPO

TYPED = ["dynagraph", "components", "graphs", "tools"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, check=False)


def test_ruff_is_clean() -> None:
    out = _run("ruff", "check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(600)
def test_mypy_strict_is_clean() -> None:
    out = _run("mypy", "--strict", *TYPED)
    assert out.returncode == 0, out.stdout + out.stderr
