"""Conditional disaggregation: should this request's prefill run on a prefill worker?

The decision is a pure function of the config, the prompt length, how much of it the
decode worker already has cached, and the prefill-queue depth (``PrefillQueue.depth()``:
jobs not yet picked up by any prefill worker)::

    remote  <=>  remote-prefill
                 and (not conditional-disagg
                      or (prompt_len - cached_len > max-local-prefill-length
                          and queue_depth < max-prefill-queue-size))

The two thresholds are also runtime settings in etcd under
``/{namespace}/settings/{component}/{key}``; ``LiveDisaggSettings`` applies the
``(key, value)`` pairs of a watch on that prefix without a restart. A deleted key
falls back to the value from the config file; a bad value is logged and ignored.

If the decode worker sends a job and no prefill result arrives within
``remote-prefill-timeout`` seconds (the job's deadline), it prefills locally, so a
request is never lost to a missing prefill worker.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class DisaggConfig(BaseModel):
    """Disaggregation settings of a decode worker (YAML keys in kebab-case).

    A worker config model may subclass this to carry the same keys at its top level.
    """

    model_config = ConfigDict(
        alias_generator=_kebab, populate_by_name=True, extra="forbid", frozen=True
    )

    remote_prefill: bool = False
    conditional_disagg: bool = True
    max_local_prefill_length: int = Field(default=1000, ge=0)
    max_prefill_queue_size: int = Field(default=2, ge=0)
    remote_prefill_timeout: float = Field(default=10.0, gt=0)


Reason = Literal["remote-prefill-off", "unconditional", "short-prompt", "queue-full", "long-prompt"]
"""Why a decision was made; a small fixed set, usable as a metric label."""


@dataclass(frozen=True)
class PrefillDecision:
    remote: bool
    reason: Reason
    uncached_len: int


def decide_prefill(cfg: DisaggConfig, prompt_len: int, cached_len: int, queue_depth: int) -> PrefillDecision:
    """Local or remote prefill for one request (pure; see the module docstring)."""
    if prompt_len < 0 or queue_depth < 0 or not 0 <= cached_len <= prompt_len:
        raise ValueError(
            f"need 0 <= cached_len <= prompt_len and queue_depth >= 0, got "
            f"prompt_len={prompt_len} cached_len={cached_len} queue_depth={queue_depth}"
        )
    uncached = prompt_len - cached_len
    if not cfg.remote_prefill:
        return PrefillDecision(False, "remote-prefill-off", uncached)
    if not cfg.conditional_disagg:
        return PrefillDecision(True, "unconditional", uncached)
    if uncached <= cfg.max_local_prefill_length:
        return PrefillDecision(False, "short-prompt", uncached)
    if queue_depth >= cfg.max_prefill_queue_size:
        return PrefillDecision(False, "queue-full", uncached)
    return PrefillDecision(True, "long-prompt", uncached)


LIVE_KEYS: Final = ("max-local-prefill-length", "max-prefill-queue-size")
"""Settings that may change at run time through etcd."""

DEFAULT_COMPONENT: Final = "VllmWorker"


def settings_prefix(namespace: str, component: str = DEFAULT_COMPONENT) -> str:
    """``/{namespace}/settings/{component}/``: the etcd prefix to watch."""
    return f"/{namespace}/settings/{component}/"


def settings_key(namespace: str, key: str, component: str = DEFAULT_COMPONENT) -> str:
    """Full etcd key of one live setting, e.g. ``/dynamo/settings/VllmWorker/max-prefill-queue-size``."""
    if key not in LIVE_KEYS:
        raise ValueError(f"{key!r} is not a live disaggregation setting; use one of {LIVE_KEYS}")
    return settings_prefix(namespace, component) + key


class LiveDisaggSettings:
    """The current disaggregation config of one decode worker, updated from etcd.

    The decode worker calls ``decide`` per request; a background task runs
    ``follow(discovery.watch_prefix(self.prefix))``. Single event loop; no locking needed
    because ``current`` is replaced, never mutated.
    """

    def __init__(
        self, base: DisaggConfig, *, namespace: str, component: str = DEFAULT_COMPONENT
    ) -> None:
        self.base = base
        self.prefix = settings_prefix(namespace, component)
        self._current = base

    @property
    def current(self) -> DisaggConfig:
        return self._current

    def decide(self, prompt_len: int, cached_len: int, queue_depth: int) -> PrefillDecision:
        return decide_prefill(self._current, prompt_len, cached_len, queue_depth)

    def apply(self, key: str, value: Any | None) -> bool:
        """Apply one watched ``(key, value)``; ``None`` means deleted. True if it changed a value."""
        if not key.startswith(self.prefix):
            return False
        name = key[len(self.prefix):]
        if name not in LIVE_KEYS:
            log.debug("ignoring setting %s: not a live disaggregation setting", key)
            return False
        field = name.replace("-", "_")
        if value is None:
            new_value: Any = getattr(self.base, field)
        else:
            try:
                new_value = _parse_int(value)
                updated = DisaggConfig.model_validate({**self._current.model_dump(), field: new_value})
            except (ValueError, ValidationError) as e:
                log.warning(
                    "ignoring bad value %r for %s (keeping %s): %s",
                    value, key, getattr(self._current, field), _first_line(e),
                )
                return False
            new_value = getattr(updated, field)
        old_value = getattr(self._current, field)
        if new_value == old_value:
            return False
        self._current = self._current.model_copy(update={field: new_value})
        log.info("%s: %s -> %s%s", name, old_value, new_value, " (deleted; config value)" if value is None else "")
        return True

    async def follow(self, updates: AsyncIterable[tuple[str, Any | None]]) -> None:
        """Apply every pair from ``updates`` until it ends (or the task is cancelled)."""
        async for key, value in updates:
            self.apply(key, value)


def _parse_int(value: Any) -> int:
    """An int from an etcd value (int, or str/bytes holding one); bools and fractions refused."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a count")
    if isinstance(value, bytes | bytearray):
        value = value.decode("utf-8", errors="strict")
    if isinstance(value, str):
        return int(value.strip())
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not a whole number")
        return int(value)
    if isinstance(value, int):
        return value
    raise ValueError(f"unsupported type {type(value).__name__}")


def _first_line(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(str(err["msg"]) for err in e.errors())
    return str(e) or type(e).__name__
