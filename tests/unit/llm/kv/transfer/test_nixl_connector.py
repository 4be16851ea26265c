"""``nixl_connector.NixlConnector.start_load_kv`` settles only the reads its step posted."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from dynagraph.llm.kv.transfer import nixl_connector
from tests.support.nixl import FakeNixlAgent


def connector(budget_s: float) -> tuple[Any, Any]:
    agent = FakeNixlAgent()
    worker = SimpleNamespace(nixl_wrapper=agent,
                             _recving_transfers=defaultdict(list, {"old": [1]}))
    conn: Any = object.__new__(nixl_connector.NixlConnector)  # no engine: what the method reads
    conn.connector_worker = worker
    conn._settle_s = budget_s
    return conn, worker


def post_two(monkeypatch: pytest.MonkeyPatch, worker: Any) -> None:
    def start_load_kv(self: Any, forward_context: Any, **kwargs: Any) -> None:
        worker._recving_transfers["new"] += [2, 3]
        worker.nixl_wrapper.left = {2: 1, 3: 3}

    monkeypatch.setattr(NixlConnector, "start_load_kv", start_load_kv)  # vLLM's, which posts


def test_the_reads_this_step_posted_are_polled_until_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    conn, worker = connector(5.0)  # ends when they are done; generous for a loaded box
    post_two(monkeypatch, worker)
    conn.start_load_kv(None)
    assert 1 not in worker.nixl_wrapper.checked  # posted in an earlier step: vLLM's to poll
    assert worker.nixl_wrapper.checked == [2, 3, 3, 3]


def test_no_budget_leaves_polling_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    conn, worker = connector(0.0)
    post_two(monkeypatch, worker)
    conn.start_load_kv(None)
    assert worker.nixl_wrapper.checked == []
    assert worker._recving_transfers["new"] == [2, 3]
