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
"""

from __future__ import annotations

import logging
import typing
from collections.abc import AsyncIterable, Iterable
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

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
