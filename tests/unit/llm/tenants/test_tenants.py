"""Tenants file, authentication, signed identity, cache salts, quotas."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec
import pytest

from dynagraph.errors import ConfigError
from dynagraph.llm.tenants import (
    Authenticator,
    ForgedTenant,
    QuotaExceeded,
    Quotas,
    Signer,
    TenantEntry,
    TenantToken,
    load_tenants,
)

KEY_A, KEY_B = "sk-acme-0123456789", "sk-batch-0123456789"
SECRET = "x" * 64


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "tenants.yaml"
    p.write_text(text)
    return p


def test_keys_authenticate_their_tenant_and_nothing_else(tmp_path: Path) -> None:
    p = write(tmp_path, f"{KEY_A}: {{tenant: acme, slo-class: interactive}}\n"
                        f"{KEY_B}: {{tenant: batchco, tokens-per-minute: 1000}}\n")
    auth = Authenticator(p)
    a = auth.authenticate(f"Bearer {KEY_A}")
    assert a is not None and (a.tenant, a.slo_class) == ("acme", "interactive")
    b = auth.authenticate(f"bearer {KEY_B}")
    assert b is not None and b.tokens_per_minute == 1000
    for bad in (None, "", "Bearer", f"Basic {KEY_A}", f"Bearer {KEY_A}x", "Bearer sk-nope"):
        assert auth.authenticate(bad) is None


def test_errors_name_the_entry_never_the_key(tmp_path: Path) -> None:
    p = write(tmp_path, f"{KEY_A}: {{tenant: acme}}\n{KEY_B}: {{tenant: 'bad name!'}}\n")
    with pytest.raises(ConfigError) as info:
        load_tenants(p)
    assert "entry 2" in str(info.value) and KEY_B not in str(info.value)
    with pytest.raises(ConfigError, match="at least 8"):
        load_tenants(write(tmp_path, "short: {tenant: a}\n"))
    with pytest.raises(ConfigError, match="unknown|Extra"):
        load_tenants(write(tmp_path, f"{KEY_A}: {{tenant: a, colour: red}}\n"))


def test_a_changed_file_is_reloaded_and_a_broken_one_ignored(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    p = write(tmp_path, f"{KEY_A}: {{tenant: acme}}\n")
    auth = Authenticator(p, check_every=1.0, clock=lambda: now[0])
    p.write_text(f"{KEY_B}: {{tenant: batchco}}\n")
    os.utime(p, (1, 10**9))
    assert auth.authenticate(f"Bearer {KEY_A}") is not None  # not re-checked yet
    now[0] = 2.0
    assert auth.authenticate(f"Bearer {KEY_A}") is None
    assert auth.authenticate(f"Bearer {KEY_B}") is not None
    p.write_text("{{{ broken")
    os.utime(p, (1, 2 * 10**9))
    now[0] = 4.0
    with caplog.at_level(logging.ERROR):
        assert auth.authenticate(f"Bearer {KEY_B}") is not None  # old keys stay
    assert "not reloaded" in caplog.text and KEY_B not in caplog.text


def test_signed_identity_verifies_and_forgeries_do_not() -> None:
    signer = Signer(SECRET)
    token = signer.sign("acme", "interactive", "req-1")
    assert signer.verify(token) == token and token.issued_for == "req-1"
    forged = [
        None,
        TenantToken(tenant="acme", slo_class="interactive", issued_for="req-1"),  # unsigned
        msgspec.structs.replace(token, tenant="other"),      # another tenant
        msgspec.structs.replace(token, slo_class="batch"),   # another class
        msgspec.structs.replace(token, issued_for="req-2"),  # moved to another request
    ]
    for bad in forged:
        with pytest.raises(ForgedTenant):
            signer.verify(bad)
    with pytest.raises(ForgedTenant):
        Signer("y" * 64).verify(token)  # another graph's secret


def test_cache_salts_differ_per_tenant_and_hide_the_name() -> None:
    signer = Signer(SECRET)
    a, b = signer.cache_salt("acme"), signer.cache_salt("batchco")
    assert a != b and "acme" not in a and a == signer.cache_salt("acme")
    assert Signer("y" * 64).cache_salt("acme") != a


def test_quotas_refuse_with_retry_after_and_refill() -> None:
    now = [0.0]
    q = Quotas(clock=lambda: now[0])
    entry = TenantEntry(tenant="acme", requests_per_minute=2, tokens_per_minute=600)
    q.admit(entry, 100)
    q.admit(entry, 100)
    with pytest.raises(QuotaExceeded, match="requests per minute") as info:
        q.admit(entry, 100)
    assert info.value.retry_after == 30  # one request refills in 30 s
    now[0] = 30.0
    q.admit(entry, 100)
    q.settle(entry, 100, 20)  # used 20 of 100: 80 back
    heavy = TenantEntry(tenant="heavy", tokens_per_minute=100)
    q.admit(heavy, 100)
    with pytest.raises(QuotaExceeded, match="tokens per minute"):
        q.admit(heavy, 50)
    unlimited = TenantEntry(tenant="free")
    for _ in range(100):
        q.admit(unlimited, 10**6)
