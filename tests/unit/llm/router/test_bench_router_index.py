"""Smoke run of benchmarks/router_index.py at a tiny scale (keeps the script from rotting)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

SCRIPT = Path(__file__).resolve().parents[4] / "benchmarks" / "router_index.py"


def test_router_index_benchmark_runs_small() -> None:
    spec = importlib.util.spec_from_file_location("bench_router_index", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        args = ["--rounds", "2", "--workers", "4", "--blocks-per-worker", "5000"]
        args += ["--queries", "50", "--no-write"]
        assert module.main(args) == 0
    finally:
        sys.modules.pop(spec.name, None)
