"""Per-tenant rate limits: requests and tokens per minute, as token buckets. Pure.

A tenant's bucket holds up to one minute's allowance and refills continuously. A request
takes one request token and its *expected* tokens (prompt + max_tokens) at admission;
what it did not use is given back when it ends, so a tenant is charged for what it used.
Refusals say when to come back (``retry_after`` seconds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dynagraph.llm.tenants.registry import TenantEntry


@dataclass
class _Bucket:
    rate_per_s: float
    capacity: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate_per_s)
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0 if it is now)."""
        if amount <= self.level:
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate_per_s


class QuotaExceeded(Exception):
    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Quotas:
    clock: Callable[[], float] = time.monotonic
    _requests: dict[str, _Bucket] = field(default_factory=dict)
    _tokens: dict[str, _Bucket] = field(default_factory=dict)

    def _bucket(self, table: dict[str, _Bucket], tenant: str, per_minute: float) -> _Bucket:
        now = self.clock()
        b = table.get(tenant)
        if b is None or b.capacity != per_minute:
            b = table[tenant] = _Bucket(per_minute / 60.0, per_minute, per_minute, now)
        b.refill(now)
        return b

    def admit(self, entry: TenantEntry, expected_tokens: int) -> None:
        """Take one request and ``expected_tokens`` from the tenant's buckets, or raise
        :class:`QuotaExceeded` (nothing taken)."""
        checks: list[tuple[_Bucket, float, str]] = []
        if entry.requests_per_minute is not None:
            checks.append((self._bucket(self._requests, entry.tenant,
                                        entry.requests_per_minute), 1.0, "requests"))
        if entry.tokens_per_minute is not None:
            want = float(min(expected_tokens, entry.tokens_per_minute))
            checks.append((self._bucket(self._tokens, entry.tenant, entry.tokens_per_minute),
                           want, "tokens"))
        for bucket, amount, what in checks:
            wait = bucket.wait_for(amount)
            if wait > 0:
                raise QuotaExceeded(f"tenant {entry.tenant}: {what} per minute exhausted",
                                    max(1, math.ceil(min(wait, 60.0))))
        for bucket, amount, _ in checks:
            bucket.level -= amount

    def settle(self, entry: TenantEntry, expected_tokens: int, used_tokens: int) -> None:
        """Give back what a finished request did not use of its expected tokens."""
        if entry.tokens_per_minute is None:
            return
        unused = min(expected_tokens, entry.tokens_per_minute) - used_tokens
        if unused > 0:
            b = self._bucket(self._tokens, entry.tenant, entry.tokens_per_minute)
            b.level = min(b.capacity, b.level + unused)
