"""vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) for tests.

Started the way the agg graph serves the same model: block size 32, eager mode, the
same chat template, the ``hermes`` tool parser with auto tool choice, prompt token
details (cached tokens) on. It runs in its own session; :meth:`stop` ends the whole
process group (API server and engine core, which runs the model).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from dynagraph.runtime.infra import free_port
from tests.support.serve import REPO

CHAT_TEMPLATE = REPO / "configs" / "templates" / "chatml_tools.jinja"


class VllmServer:
    def __init__(self, model_dir: Path, *, served_name: str, max_model_len: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
        # The model runs in the engine core's process (two processes, not three): this
        # server is the reference for the API's behaviour, not for its process layout.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
             "--model", str(model_dir), "--served-model-name", served_name,
             "--host", "127.0.0.1", "--port", str(self.port), "--block-size", "32",
             "--max-model-len", str(max_model_len), "--max-num-seqs", "64",
             "--enforce-eager", "--seed", "0", "--disable-log-stats",
             "--disable-uvicorn-access-log", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes", "--chat-template", str(CHAT_TEMPLATE),
             "--enable-prompt-tokens-details",
             "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("vLLM's server exited:\n" + "\n".join(self.lines[-60:]))
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise AssertionError("vLLM's server not ready:\n" + "\n".join(self.lines[-60:]))

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
