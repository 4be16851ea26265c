"""The Frontend's side of tenants: who is calling (401), may it (429), and the signed
identity the request carries on (see ``dynagraph.llm.tenants``).

With a tenants file every API route needs ``Authorization: Bearer KEY``; ``/health``,
``/metrics`` and ``/openapi.json`` stay open. The request's SLO class is the tenant's,
or a lower one named by the ``x-slo-class`` header (a tenant may lower its own priority,
never raise it). Without a tenants file the service is open and the header picks any
known class.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynagraph.llm.http.errors import HTTPError
from dynagraph.llm.tenants import (
    OPEN_TENANT,
    Authenticator,
    QuotaExceeded,
    Quotas,
    Signer,
    TenantEntry,
    TenantToken,
)

SLO_HEADER = "x-slo-class"
OPEN = TenantEntry(tenant=OPEN_TENANT)


class TenantGate:
    def __init__(self, authenticator: Authenticator | None, signer: Signer | None,
                 class_priority: Mapping[str, int], quotas: Quotas | None = None) -> None:
        if authenticator is not None and signer is None:
            raise ValueError("tenants need the graph secret (DYNAGRAPH_GRAPH_SECRET)")
        self.authenticator = authenticator
        self.signer = signer
        self.class_priority = dict(class_priority)
        self.quotas = quotas or Quotas()

    @property
    def required(self) -> bool:
        return self.authenticator is not None

    def identify(self, headers: Mapping[str, str]) -> TenantEntry:
        """The caller's entry (``OPEN`` without a tenants file); 401 for a bad key."""
        if self.authenticator is None:
            return OPEN
        entry = self.authenticator.authenticate(headers.get("authorization"))
        if entry is None:
            raise HTTPError(401, "a valid API key is required (Authorization: Bearer KEY)",
                            type="authentication_error", code="invalid_api_key",
                            headers={"www-authenticate": "Bearer"})
        return entry

    def slo_class(self, entry: TenantEntry, headers: Mapping[str, str]) -> str:
        asked = headers.get(SLO_HEADER)
        own = entry.slo_class
        if asked is None or asked == own:
            return own
        if asked not in self.class_priority:
            raise HTTPError(400, f"unknown SLO class {asked!r} (known: "
                            f"{', '.join(sorted(self.class_priority))})", param=SLO_HEADER)
        if entry is not OPEN and self.class_priority[asked] < self.class_priority.get(own, 0):
            raise HTTPError(403, f"tenant {entry.tenant} may not raise its SLO class to "
                            f"{asked!r}", type="permission_error", param=SLO_HEADER)
        return asked

    def admit(self, entry: TenantEntry, expected_tokens: int) -> None:
        try:
            self.quotas.admit(entry, expected_tokens)
        except QuotaExceeded as exc:
            raise HTTPError(429, str(exc), type="rate_limit_exceeded", code="quota_exceeded",
                            headers={"retry-after": str(exc.retry_after)}) from None

    def settle(self, entry: TenantEntry, expected_tokens: int, used_tokens: int) -> None:
        self.quotas.settle(entry, expected_tokens, used_tokens)

    def token(self, entry: TenantEntry, slo_class: str, request_id: str) -> TenantToken | None:
        """The signed identity to carry on (None for an open service's default class)."""
        if self.signer is None or (entry is OPEN and slo_class == OPEN.slo_class):
            return None
        return self.signer.sign(entry.tenant, slo_class, request_id,
                                self.class_priority.get(slo_class, 0))
