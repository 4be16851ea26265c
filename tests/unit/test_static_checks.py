"""ruff and mypy --strict over the project, as part of the fast set (and of .ci/run)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.support.paths import REPO

TYPED = ["dynagraph", "components", "graphs", "tools", "benchmarks/profiling"]


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


def _imported_modules(root: str) -> dict[str, set[str]]:
    """Every module each ``.py`` file under ``root`` imports (function-level included)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / root).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = names
    return found


@pytest.mark.parametrize(("root", "forbidden"), [
    ("dynagraph/observability", "dynagraph.llm"),  # component metric groups live in llm/
    ("tools", "benchmarks"),  # profiling scripts live in benchmarks/profiling
    ("dynagraph/cli", "dynagraph.llm"),  # the supervisor's CPU, niceness, secret: runtime/
    ("dynagraph/runtime", "dynagraph.llm"),
    ("dynagraph/sdk", "dynagraph.llm"),
])
def test_imports_point_one_way(root: str, forbidden: str) -> None:
    bad = {f: sorted(m for m in mods if m == forbidden or m.startswith(forbidden + "."))
           for f, mods in _imported_modules(root).items()}
    assert not {f: m for f, m in bad.items() if m}


def test_the_graphs_load_without_torch_or_vllm() -> None:
    """Every component process imports its graph module: Frontend, Processor and Router
    processes must not pay for torch or vLLM (seconds of CPU each at start-up); only an
    engine loads them, when it starts."""
    graphs = sorted(p.stem for p in (REPO / "graphs").glob("*.py") if p.stem != "__init__")
    code = ("import importlib, sys\n"
            f"for g in {graphs!r}: importlib.import_module('graphs.' + g)\n"
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
