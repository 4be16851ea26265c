"""Config fields that can change while a component runs, through etcd.

A component names some fields of its typed config as live; their current values come
from keys ``/{namespace}/settings/{Component}/{field-in-kebab-case}`` (what
``etcdctl put /dynamo/settings/Router/mode '"round-robin"'`` writes; JSON values,
plain strings and numbers accepted). A value is validated against the config model
(constraints included); a bad one is logged and ignored, a deleted key restores the
config file's value. ``current`` is replaced on change, never mutated, so a reader on
the same event loop needs no lock.

    live = LiveSettings(config, prefix=runtime.settings_prefix(), live=["mode"])
    task = asyncio.create_task(live.follow(runtime.discovery.watch_prefix(live.prefix)))
    live.current.mode

A component declares its live settings once, as a `LiveSpec` class attribute
``LIVE_SETTINGS`` (read by `live_spec_of`); it binds the spec to its config at run time
(``self.LIVE_SETTINGS.bind(config, prefix)``) and ``dynamo settings`` validates what it
writes with the same spec (`LiveSpec.parse`), so the two cannot disagree.
"""

from __future__ import annotations

import enum
import logging
import typing
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar

import annotated_types
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from dynagraph.config import kebab

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class LiveSettings(Generic[M]):
    """The live view of ``base``: the fields named in ``live`` follow etcd keys under ``prefix``."""

    def __init__(self, base: M, *, prefix: str, live: Iterable[str]) -> None:
        self.base = base
        self.prefix = prefix
        self._fields = {kebab(name): name.replace("-", "_") for name in live}
        unknown = [f for f in self._fields.values() if f not in type(base).model_fields]
        if unknown:
            raise ValueError(f"{type(base).__name__} has no field(s) {unknown}")
        self._current = base
        self._set: set[str] = set()

    @property
    def current(self) -> M:
        return self._current

    @property
    def names(self) -> list[str]:
        """The live settings' names as their keys spell them (kebab-case)."""
        return list(self._fields)

    def key(self, name: str) -> str:
        """The etcd key of the live setting ``name`` (kebab- or snake-case)."""
        name = kebab(name)
        if name not in self._fields:
            raise ValueError(f"{name!r} is not a live setting; use one of {self.names}")
        return self.prefix + name

    def is_set(self, name: str) -> bool:
        """True while etcd holds a value for ``name`` (it overrides the config file)."""
        return self._fields.get(kebab(name), "") in self._set

    def apply(self, key: str, value: Any | None) -> bool:
        """Apply one watched ``(key, value)`` (``None``: deleted). True if a value changed."""
        if not key.startswith(self.prefix):
            return False
        name = key[len(self.prefix):]
        field = self._fields.get(name)
        if field is None:
            log.debug("ignoring setting %s: not a live setting (%s)", key, ", ".join(self.names))
            return False
        if value is None:
            self._set.discard(field)
            new_value = getattr(self.base, field)
        else:
            try:
                updated = type(self.base).model_validate(
                    {**self._current.model_dump(), field: _plain(value, self._annotation(field))})
            except (ValueError, ValidationError) as e:
                log.warning("ignoring bad value %r for %s (keeping %s): %s", value, key,
                            getattr(self._current, field), _why(e))
                return False
            self._set.add(field)
            new_value = getattr(updated, field)
        old_value = getattr(self._current, field)
        if new_value == old_value:
            return False
        self._current = self._current.model_copy(update={field: new_value})
        log.info("%s: %s -> %s%s", name, old_value, new_value,
                 " (deleted; config value)" if value is None else "")
        return True

    async def follow(self, updates: AsyncIterable[tuple[str, Any | None]]) -> None:
        """Apply every pair of ``updates`` (a discovery ``watch_prefix``) until it ends."""
        async for key, value in updates:
            self.apply(key, value)

    def _annotation(self, field: str) -> Any:
        return type(self.base).model_fields[field].annotation


class SettingError(ValueError):
    """A live setting that does not exist, or a value it does not accept."""


@dataclass(frozen=True)
class LiveSpec(Generic[M]):
    """The live settings of a component: fields ``names`` (kebab-case) of config ``model``.

    Declared once per component class as ``LIVE_SETTINGS``; `bind` gives the running
    component its `LiveSettings`, `parse` validates a value for ``dynamo settings``.
    """

    model: type[M]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(kebab(n) for n in self.names))
        unknown = [n for n in self.names if _snake(n) not in self.model.model_fields]
        if unknown:
            raise ValueError(f"{self.model.__name__} has no field(s) {unknown}")

    def bind(self, base: M, prefix: str) -> LiveSettings[M]:
        """The live view of ``base`` (a config of this spec's model) under ``prefix``."""
        if not isinstance(base, self.model):
            raise TypeError(f"expected a {self.model.__name__}, got {type(base).__name__}")
        return LiveSettings(base, prefix=prefix, live=self.names)

    def check_name(self, name: str) -> str:
        """``name`` in kebab-case if it is one of these settings, else SettingError."""
        key = kebab(name)
        if key not in self.names:
            raise SettingError(f"{key!r} is not a live setting; live settings: "
                               f"{', '.join(self.names)}")
        return key

    def default(self, name: str) -> Any:
        """The model's default for ``name`` (what applies when neither etcd nor the
        config file sets it)."""
        return self.model.model_fields[_snake(self.check_name(name))].get_default(
            call_default_factory=True)

    def parse(self, name: str, value: Any) -> Any:
        """``value`` (a command-line string, or a decoded etcd value) validated as the
        running component validates it; SettingError naming the allowed values if not."""
        info = self.model.model_fields[_snake(self.check_name(name))]
        try:
            plain = _plain(value, info.annotation)
            return _adapter(info).validate_python(plain)
        except (ValueError, ValidationError) as e:
            raise SettingError(f"{value!r} is not allowed: expected {self.describe(name)}"
                               ) from e

    def to_json(self, name: str, value: Any) -> Any:
        """A validated value as JSON (what goes into etcd): enums as their values."""
        info = self.model.model_fields[_snake(self.check_name(name))]
        return _adapter(info).dump_python(value, mode="json")

    def describe(self, name: str) -> str:
        """The values ``name`` accepts, in words: ``one of kv, kv-load`` or
        ``a number >= 0``."""
        info = self.model.model_fields[_snake(self.check_name(name))]
        return describe_annotation(info.annotation, info.metadata)


def describe_annotation(annotation: Any, metadata: Iterable[Any] = ()) -> str:
    """Words for the values of a field: its choices, or its type and bounds."""
    args = typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if annotation is bool:
        return "true or false"
    words = {int: "an integer", float: "a number", str: "a string"}
    kinds = [words[a] for a in (args or (annotation,)) if a in words]
    what = " or ".join(kinds) or getattr(annotation, "__name__", str(annotation))
    bounds = []
    for m in metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                bounds.append(f"{op} {getattr(m, attr):g}")
    return " ".join([what, *bounds])


def live_spec_of(cls: type) -> LiveSpec[Any] | None:
    """The `LiveSpec` a component class declares as ``LIVE_SETTINGS``, if any."""
    spec = getattr(cls, "LIVE_SETTINGS", None)
    return spec if isinstance(spec, LiveSpec) else None


def _adapter(info: FieldInfo) -> TypeAdapter[Any]:
    """Validates one field alone, constraints included."""
    form: Any = info.annotation
    if info.metadata:  # built at run time, so mypy cannot check it
        form = Annotated[(form, *info.metadata)]
    return TypeAdapter(form)


def _snake(name: str) -> str:
    return name.replace("-", "_")


def _plain(value: Any, annotation: Any) -> Any:
    """An etcd value as the model should see it: bytes decoded, and no booleans or
    fractions where a number is expected (pydantic's lax mode would take ``True`` as 1)."""
    if isinstance(value, bytes | bytearray):
        value = value.decode("utf-8", errors="strict").strip()
    numeric = {int, float} & set(typing.get_args(annotation) or (annotation,))
    if numeric:
        if isinstance(value, bool):
            raise ValueError("a boolean is not a number")
        if isinstance(value, str):
            value = value.strip()
        if int in numeric and float not in numeric and isinstance(value, float):
            if not value.is_integer():
                raise ValueError("not a whole number")
            value = int(value)
    return value


def _why(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(str(err["msg"]) for err in e.errors())
    return str(e) or type(e).__name__
