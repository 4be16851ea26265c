"""Schemathesis fuzzes the served HTTP API from its own /openapi.json: no 5xx, and the
service still answers normally afterwards."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.serve import ServeProcess

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MODEL = "tiny-llama"


def test_fuzzing_finds_no_server_error(base_url: str, agg_graph: ServeProcess,
                                       tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st is not None, "schemathesis is a test dependency (pip install -e .[test])"
    out = subprocess.run(
        [st, "run", f"{base_url}/openapi.json", "--checks", "not_a_server_error",
         # one worker thread: two compile ASTs at once in hypothesis (describing its
         # strategies), and CPython 3.11.7's AST recursion-depth check then fails one of
         # them now and then ("SystemError: AST constructor recursion depth mismatch",
         # python/cpython#106905), a fuzzer crash with every generated case passing
         "--max-examples", "25", "--generation-deterministic", "--workers", "1",
         "--request-timeout", "60", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, check=False,
        cwd=tmp_path)  # schemathesis keeps a .schemathesis/ cache in its working directory
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    health = httpx.get(f"{base_url}/health", timeout=10)
    assert health.status_code == 200
    r = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
