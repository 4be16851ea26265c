"""The tenants file: API keys -> tenants, checked per request, reloaded when it changes.

```yaml
# API key -> tenant (and optionally its SLO class and rate limits)
sk-acme-7f3a...:   {tenant: acme, slo-class: interactive, requests-per-minute: 600}
sk-nightly-9c1e...: {tenant: batchco, slo-class: batch, tokens-per-minute: 200000}
```

Keys are kept only as SHA-256 digests and looked up by the digest of the presented key
(``hmac.compare_digest`` on the match), so the check takes the same time whichever key is
close; a key never appears in an error, a log line or a metric (entries are named by
their position and tenant). The file is re-read when its modification time changes; a
broken new version is logged and the previous keys stay in force.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from dynagraph.config import ConfigModel
from dynagraph.errors import ConfigError

log = logging.getLogger(__name__)


class TenantEntry(ConfigModel):
    """One API key's tenant."""

    tenant: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    slo_class: str = "default"
    requests_per_minute: float | None = Field(default=None, gt=0)
    tokens_per_minute: float | None = Field(default=None, gt=0)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).digest()


def load_tenants(path: str | Path) -> dict[bytes, TenantEntry]:
    """key digest -> entry; ``ConfigError`` naming the file and entry (never the key)."""
    file = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the tenants file: {exc.strerror}", file=file) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"broken YAML: {exc}", file=file) from exc
    if not isinstance(data, dict) or not data:
        raise ConfigError("must map API keys to tenants (at least one)", file=file)
    out: dict[bytes, TenantEntry] = {}
    for n, (key, raw) in enumerate(data.items(), start=1):
        where = f"entry {n}"
        if not isinstance(key, str) or len(key) < 8:
            raise ConfigError(f"{where}: an API key must be a string of at least 8 characters",
                              file=file)
        if isinstance(raw, dict) and isinstance(raw.get("tenant"), str):
            where += f" (tenant {raw['tenant']})"
        try:
            entry = TenantEntry.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "-"
            raise ConfigError(f"{where}: {field}: {err['msg']}", file=file) from None
        digest = _digest(key)
        if digest in out:
            raise ConfigError(f"{where}: the same API key is listed twice", file=file)
        out[digest] = entry
    return out


class Authenticator:
    """``authenticate(authorization_header)`` -> the caller's entry, or None."""

    def __init__(self, path: str | Path, *, check_every: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._entries = load_tenants(self.path)
        self._mtime = self._stat()
        self._check_every = check_every
        self._checked = clock()
        self._clock = clock

    @property
    def tenants(self) -> list[str]:
        return sorted({e.tenant for e in self._entries.values()})

    def _stat(self) -> float:
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return -1.0

    def maybe_reload(self) -> None:
        """Re-read the file if it changed (at most once per ``check_every`` seconds)."""
        now = self._clock()
        if now - self._checked < self._check_every:
            return
        self._checked = now
        mtime = self._stat()
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            self._entries = load_tenants(self.path)
        except ConfigError as exc:
            log.error("tenants file not reloaded, the previous keys stay: %s", exc)
            return
        log.info("tenants file reloaded: %d keys, tenants %s", len(self._entries),
                 ", ".join(self.tenants))

    def authenticate(self, authorization: str | None) -> TenantEntry | None:
        self.maybe_reload()
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = _digest(key.strip())
        entry = self._entries.get(digest)
        if entry is None:
            return None
        for known in self._entries:  # constant-time confirmation of the match
            if hmac.compare_digest(known, digest):
                return entry
        return None


def describe(entries: dict[bytes, TenantEntry]) -> list[dict[str, Any]]:
    """The tenants without their keys (for status output and tests)."""
    return [e.model_dump(by_alias=True) for e in entries.values()]
