"""The Engine protocol's contract (``tests/contract/test_engine_contract.py``) against the
session's vLLM engine."""

from __future__ import annotations

import pytest

from tests.contract.test_engine_contract import EngineContract, Subject

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


class TestVllmEngine(EngineContract):
    @pytest.fixture
    def subject(self, vllm_engine: object) -> Subject:
        return Subject(vllm_engine, vllm_engine.max_model_len)  # type: ignore[attr-defined]
