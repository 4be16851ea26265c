"""The order a component process starts its embedded components in: callees first."""

from __future__ import annotations

from dynagraph.sdk._config import callees_first
from tests.unit.sdk.example_components import pipeline


def test_embedded_components_start_after_what_they_call() -> None:
    assert callees_first(pipeline, ["Middle", "Back"]) == ["Back", "Middle"]
    assert callees_first(pipeline, ["Back", "Middle"]) == ["Back", "Middle"]
    assert callees_first(pipeline, ["Middle"]) == ["Middle"]
    assert callees_first(pipeline, []) == []
