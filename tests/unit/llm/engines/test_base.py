"""Engine value types: validation and wire round trips."""

from __future__ import annotations

import msgpack
import pytest
from pydantic import ValidationError

from dynagraph.llm.engines import EngineLoad, EngineOutput, SamplingSpec


def test_sampling_defaults() -> None:
    spec = SamplingSpec()
    assert spec.max_tokens is None
    assert spec.temperature == 1.0
    assert spec.stop_token_ids == []
    assert not spec.ignore_eos


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"frequency_penalty": 3.0},
        {"unknown": 1},
    ],
)
def test_sampling_rejects(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SamplingSpec.model_validate(bad)


def test_sampling_is_frozen() -> None:
    spec = SamplingSpec(max_tokens=3)
    with pytest.raises(ValidationError):
        spec.max_tokens = 4  # type: ignore[misc]


def test_types_round_trip_through_msgpack() -> None:
    spec = SamplingSpec(max_tokens=8, temperature=0.0, seed=3, stop_token_ids=[1, 3])
    out = EngineOutput(
        token_ids=[5, 6],
        finish_reason="length",
        num_prompt_tokens=10,
        num_cached_tokens=8,
        kv_transfer_params={"remote_block_ids": [1, 2], "do_remote_decode": False},
    )
    load = EngineLoad(running=1, waiting=2, kv_blocks_used=3, kv_blocks_total=4)
    for value in (spec, out, load):
        wire = msgpack.packb(value.model_dump())
        assert type(value).model_validate(msgpack.unpackb(wire)) == value


def test_output_rejects_unknown_finish_reason() -> None:
    with pytest.raises(ValidationError):
        EngineOutput(token_ids=[], finish_reason="error")  # type: ignore[arg-type]


def test_kv_usage() -> None:
    assert EngineLoad().kv_usage == 0.0
    assert EngineLoad(kv_blocks_used=25, kv_blocks_total=100).kv_usage == 0.25
