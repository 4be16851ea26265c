"""`LiveSpec`: a component's declaration of its live settings, and the one validation that
``dynamo settings`` and the running component share."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import Field

from dynagraph.config import ConfigModel
from dynagraph.runtime.live_settings import LiveSpec, SettingError, live_spec_of


class Knobs(ConfigModel):
    level: Literal["low", "high"] = "low"
    rate: float = Field(default=1.0, gt=0, le=10)
    count: int = Field(default=3, ge=1)
    flag: bool = False
    fixed: str = "x"


SPEC = LiveSpec(Knobs, ("level", "rate", "count", "flag"))


def test_names_are_kebab_case_and_must_be_fields() -> None:
    assert LiveSpec(Knobs, ("level",)).names == ("level",)
    with pytest.raises(ValueError, match=r"Knobs has no field\(s\) \['nope'\]"):
        LiveSpec(Knobs, ("nope",))


@pytest.mark.parametrize(("name", "words"), [
    ("level", "one of low, high"), ("rate", "a number > 0 <= 10"), ("count", "an integer >= 1"),
    ("flag", "true or false"),
])
def test_describe(name: str, words: str) -> None:
    assert SPEC.describe(name) == words


@pytest.mark.parametrize(("name", "raw", "value"), [
    ("level", "high", "high"), ("rate", "2.5", 2.5), ("rate", 10, 10.0), ("count", "7", 7),
    ("count", 7.0, 7), ("flag", "true", True),
])
def test_parse_accepts_what_the_component_accepts(name: str, raw: object, value: object) -> None:
    assert SPEC.parse(name, raw) == value
    assert SPEC.bind(Knobs(), "/ns/settings/C/").apply(f"/ns/settings/C/{name}", raw) == (
        value != getattr(Knobs(), name.replace("-", "_")))


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("level", "medium", "'medium' is not allowed: expected one of low, high"),
    ("rate", "0", "'0' is not allowed: expected a number > 0 <= 10"),
    ("rate", True, "True is not allowed: expected a number > 0 <= 10"),
    ("count", "1.5", "'1.5' is not allowed: expected an integer >= 1"),
    ("fixed", "y", "'fixed' is not a live setting; live settings: level, rate, count, flag"),
])
def test_parse_refuses_what_the_component_refuses(name: str, raw: object, message: str) -> None:
    with pytest.raises(SettingError) as exc:
        SPEC.parse(name, raw)
    assert str(exc.value) == message
    if name != "fixed":
        assert not SPEC.bind(Knobs(), "/p/").apply(f"/p/{name}", raw)


def test_bind_checks_the_model_and_live_spec_of_reads_the_class() -> None:
    class Comp:
        LIVE_SETTINGS = SPEC

    assert live_spec_of(Comp) is SPEC
    assert live_spec_of(object) is None
    with pytest.raises(TypeError):
        SPEC.bind(object(), "/p/")  # type: ignore[arg-type]  # the wrong config on purpose
    assert SPEC.to_json("rate", SPEC.parse("rate", "2")) == 2.0
    assert SPEC.default("count") == 3
