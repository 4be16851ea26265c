"""Tenants at the HTTP edge: 401 without a key, a signed identity for the backend, quotas,
SLO classes, per-tenant metrics without keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dynagraph.llm.http.tenancy import TenantGate
from dynagraph.llm.tenants import Authenticator, Signer

from .conftest import AppFactory, FakeBackend, client_for, completion_body

KEY_A, KEY_B = "sk-acme-0123456789", "sk-batch-0123456789"
SECRET = "s" * 64
PRIORITY = {"interactive": 0, "default": 5, "batch": 10}


@pytest.fixture
def gate(tmp_path: Path) -> TenantGate:
    p = tmp_path / "tenants.yaml"
    p.write_text(f"{KEY_A}: {{tenant: acme, slo-class: interactive}}\n"
                 f"{KEY_B}: {{tenant: batchco, slo-class: batch, requests-per-minute: 1}}\n")
    return TenantGate(Authenticator(p), Signer(SECRET), PRIORITY)


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **extra}


async def test_no_or_wrong_key_is_401_and_open_routes_stay_open(
        make_app: AppFactory, gate: TenantGate) -> None:
    backend = FakeBackend()
    async with client_for(make_app(backend, tenants=gate)) as client:
        for headers in ({}, auth("sk-wrong-0000000"), {"authorization": KEY_A}):
            r = await client.post("/v1/completions", json=completion_body(), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/v1/models", headers=auth(KEY_A))).status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/openapi.json")).status_code == 200
    assert backend.calls == []


async def test_the_backend_gets_a_signed_identity(make_app: AppFactory, gate: TenantGate) -> None:
    backend = FakeBackend()
    async with client_for(make_app(backend, tenants=gate)) as client:
        r = await client.post("/v1/completions", json=completion_body(),
                              headers=auth(KEY_A, **{"x-request-id": "rid-1"}))
    assert r.status_code == 200
    (token,) = backend.tenants
    assert token is not None and (token.tenant, token.slo_class, token.priority) == (
        "acme", "interactive", 0)
    assert Signer(SECRET).verify(token).issued_for == "rid-1"


async def test_slo_header_may_lower_never_raise(make_app: AppFactory, gate: TenantGate) -> None:
    backend = FakeBackend()
    async with client_for(make_app(backend, tenants=gate)) as client:
        lower = await client.post("/v1/completions", json=completion_body(),
                                  headers=auth(KEY_A, **{"x-slo-class": "batch"}))
        higher = await client.post("/v1/completions", json=completion_body(),
                                   headers=auth(KEY_B, **{"x-slo-class": "interactive"}))
        unknown = await client.post("/v1/completions", json=completion_body(),
                                    headers=auth(KEY_A, **{"x-slo-class": "gold"}))
    assert lower.status_code == 200 and backend.tenants[0].slo_class == "batch"  # type: ignore[union-attr]
    assert higher.status_code == 403 and unknown.status_code == 400


async def test_quota_is_429_with_retry_after_and_metrics_name_tenants_not_keys(
        make_app: AppFactory, gate: TenantGate, registry: CollectorRegistry) -> None:
    async with client_for(make_app(FakeBackend(), tenants=gate)) as client:
        first = await client.post("/v1/completions", json=completion_body(), headers=auth(KEY_B))
        second = await client.post("/v1/completions", json=completion_body(), headers=auth(KEY_B))
        other = await client.post("/v1/completions", json=completion_body(), headers=auth(KEY_A))
    assert first.status_code == 200 and other.status_code == 200
    assert second.status_code == 429 and second.json()["error"]["code"] == "quota_exceeded"
    assert int(second.headers["retry-after"]) >= 1
    text = generate_latest(registry).decode()
    assert 'dynamo_frontend_tenant_requests_total{status="success",tenant="batchco"} 1.0' in text
    assert 'dynamo_frontend_tenant_requests_total{status="error",tenant="batchco"} 1.0' in text
    assert KEY_A not in text and KEY_B not in text
