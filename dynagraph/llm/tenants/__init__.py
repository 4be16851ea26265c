"""Tenants: API keys, a signed identity that travels with each request, isolated prefix
caches (per-tenant cache salt) and per-tenant quotas.

    registry   the tenants file (API key -> tenant, SLO class, rate limits); Authenticator
    identity   TenantToken, Signer (HMAC with the graph's secret): sign, verify, cache_salt
    quotas     per-tenant request and token buckets
"""

from dynagraph.llm.tenants.identity import (
    OPEN_TENANT,
    ForgedTenant,
    Signer,
    TenantToken,
    cache_salt_of,
    verified,
)
from dynagraph.llm.tenants.quotas import QuotaExceeded, Quotas
from dynagraph.llm.tenants.registry import Authenticator, TenantEntry, load_tenants
from dynagraph.runtime.secret import SECRET_ENV

__all__ = ["OPEN_TENANT", "SECRET_ENV", "Authenticator", "ForgedTenant", "QuotaExceeded", "Quotas", "Signer",
           "TenantEntry", "TenantToken", "cache_salt_of", "load_tenants", "verified"]
