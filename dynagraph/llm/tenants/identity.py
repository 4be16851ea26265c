"""Who is calling, as the graph's processes pass it along: signed, and never forgeable.

The Frontend, after checking an API key, puts a :class:`TenantToken` into the request:
the tenant's name, its SLO class, the request id it was issued for, and an HMAC-SHA256
over the three, keyed
with the graph's secret (``DYNAGRAPH_GRAPH_SECRET``: ``dynamo serve`` makes one per run
unless it is set, and every process of the graph inherits it; set the same value on every
host of a multi-host graph). Every component that acts on the tenant calls
:meth:`Signer.verify`, so a caller that reaches the Processor, the Router or a worker
directly cannot claim another tenant (or any tenant) without the secret.

The per-tenant prefix-cache salt is derived from the same secret (:meth:`Signer.cache_salt`):
never the raw tenant name, so neither an engine's block hashes nor the Router's index
reveal who sent what.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

import msgspec

from dynagraph.errors import InvalidRequest
from dynagraph.runtime.secret import SECRET_ENV


class ForgedTenant(InvalidRequest):
    """A tenant token whose signature does not verify (or is missing where required)."""

    def __init__(self, message: str, *, param: str | None = "tenant",
                 code: str | None = "forged_tenant") -> None:
        super().__init__(message, param=param, code=code)


class TenantToken(msgspec.Struct, frozen=True, kw_only=True):
    """The caller's identity as it travels between components (with the request, and with
    its continuations after a migration: ``issued_for`` is the client's request id)."""

    tenant: str
    slo_class: str = "default"
    priority: int = 0
    """The class's scheduling priority (vLLM's: lower is served first)."""
    issued_for: str = ""
    sig: str = ""


OPEN_TENANT = "-"
"""The tenant of an open service (no tenants file): everyone, one shared unsalted cache."""


class Signer:
    """Signs and verifies tenant tokens and derives cache salts with one graph secret."""

    def __init__(self, secret: str) -> None:
        if len(secret) < 32:
            raise ValueError(f"{SECRET_ENV} must be at least 32 characters")
        self._key = secret.encode()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Signer | None:
        secret = environ.get(SECRET_ENV)
        return cls(secret) if secret else None

    def _mac(self, *parts: str) -> str:
        msg = "\x1f".join(parts).encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def sign(self, tenant: str, slo_class: str, request_id: str,
             priority: int = 0) -> TenantToken:
        return TenantToken(tenant=tenant, slo_class=slo_class, priority=priority,
                           issued_for=request_id,
                           sig=self._mac("tenant", tenant, slo_class, str(priority), request_id))

    def verify(self, token: TenantToken | None) -> TenantToken:
        """``token`` if its signature verifies; else :class:`ForgedTenant`."""
        if token is None:
            raise ForgedTenant("this graph requires a signed tenant identity", param="tenant")
        want = self._mac("tenant", token.tenant, token.slo_class, str(token.priority),
                         token.issued_for)
        if not hmac.compare_digest(want, token.sig):
            raise ForgedTenant("the tenant identity's signature does not verify",
                               param="tenant")
        return token

    def cache_salt(self, tenant: str) -> str:
        """The tenant's prefix-cache salt (engines and the Router hash the first block with it)."""
        return self._mac("cache-salt", tenant)[:32]


def verified(signer: Signer | None, token: TenantToken | None) -> TenantToken | None:
    """``token`` checked by a component (None passes: an open service has no tenants)."""
    if token is None:
        return None
    if signer is None:
        raise ForgedTenant(f"a tenant identity arrived but this process has no graph secret "
                           f"({SECRET_ENV})")
    return signer.verify(token)


def cache_salt_of(signer: Signer | None, token: TenantToken | None) -> str | None:
    """The prefix-cache salt of ``token``'s tenant, after checking it (None: unsalted)."""
    checked = verified(signer, token)
    if checked is None or signer is None or checked.tenant == OPEN_TENANT:
        return None
    return signer.cache_salt(checked.tenant)
