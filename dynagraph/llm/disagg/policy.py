"""Conditional disaggregation: should this request's prefill run on a prefill worker?

The decision is a pure function of the config, the prompt length, how much of it the
decode worker already has cached, and the prefill-queue depth (``PrefillQueue.depth()``:
jobs not yet picked up by any prefill worker)::

    remote  <=>  remote-prefill
                 and (not conditional-disagg
                      or (prompt_len - cached_len > max-local-prefill-length
                          and queue_depth < max-prefill-queue-size))

The two thresholds are also live settings in etcd under
``/{namespace}/settings/{component}/{key}`` (``LiveDisaggSettings``, see
``dynagraph.runtime.live_settings``).

If the decode worker sends a job and no prefill result arrives within
``remote-prefill-timeout`` seconds (the job's deadline), it prefills locally, so a
request is never lost to a missing prefill worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from pydantic import Field

from dynagraph.config import ConfigModel
from dynagraph.runtime.live_settings import LiveSettings, LiveSpec


class DisaggConfig(ConfigModel):
    """Disaggregation settings of a decode worker (YAML keys in kebab-case)."""

    remote_prefill: bool = False
    conditional_disagg: bool = True
    max_local_prefill_length: int = Field(default=1000, ge=0)
    max_prefill_queue_size: int = Field(default=2, ge=0)
    remote_prefill_timeout: float = Field(default=10.0, gt=0)
    """Seconds to wait for a prefill worker's result before prefilling locally."""


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

LIVE: Final = LiveSpec(DisaggConfig, LIVE_KEYS)
"""The decode worker's live settings (``VllmWorker.LIVE_SETTINGS``)."""

DEFAULT_COMPONENT: Final = "VllmWorker"


def settings_prefix(namespace: str, component: str = DEFAULT_COMPONENT) -> str:
    """``/{namespace}/settings/{component}/``: the etcd prefix to watch."""
    return f"/{namespace}/settings/{component}/"


def settings_key(namespace: str, key: str, component: str = DEFAULT_COMPONENT) -> str:
    """Full etcd key of one live setting, e.g. ``/dynamo/settings/VllmWorker/max-prefill-queue-size``."""
    if key not in LIVE_KEYS:
        raise ValueError(f"{key!r} is not a live disaggregation setting; use one of {LIVE_KEYS}")
    return settings_prefix(namespace, component) + key


class LiveDisaggSettings(LiveSettings[DisaggConfig]):
    """The current disaggregation config of one decode worker, updated from etcd.

    The decode worker calls ``decide`` per request; a background task runs
    ``follow(discovery.watch_prefix(self.prefix))``.
    """

    def __init__(
        self, base: DisaggConfig, *, namespace: str, component: str = DEFAULT_COMPONENT
    ) -> None:
        super().__init__(base, prefix=settings_prefix(namespace, component), live=LIVE.names)

    def decide(self, prompt_len: int, cached_len: int, queue_depth: int) -> PrefillDecision:
        return decide_prefill(self.current, prompt_len, cached_len, queue_depth)
