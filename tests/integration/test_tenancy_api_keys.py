"""API keys through the REST API (real PostgreSQL): the plaintext shown once and stored only
hashed, revoked, expired and inactive-tenant keys that stop authenticating, bad key input
refused without a write, and updates and deletes audited. Rotation and key budgets are in
test_tenancy_api_key_rotation.py."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.tenancy import selectors, services
from federation.tenancy.keys import hash_key
from federation.tenancy.models import ApiKey, Tenant
from tests.integration.tenancy_api_support import (
    KEYS,
    all_stored_text,
    assert_refused_unchanged,
    counts,
)

pytestmark = pytest.mark.django_db


def test_key_plaintext_is_shown_once_and_stored_hashed(
    operator_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme")
    created = operator_client.post(
        KEYS, {"tenant": "acme", "name": "prod", "scopes": ["inference"]}
    )
    assert created.status_code == 201, created.content
    body = created.json()
    plaintext = body["key"]
    assert plaintext.startswith(body["prefix"] + "_")
    assert body["status"] == "active"
    assert body["created_by"] == "oscar-operator"

    stored = ApiKey.objects.get(pk=body["id"])
    assert stored.key_hash == hash_key(plaintext)
    assert plaintext not in all_stored_text()
    # What follows the visible prefix (the secret itself may contain "_": URL-safe base64).
    secret = plaintext.removeprefix(body["prefix"] + "_")
    assert secret not in all_stored_text()

    detail = operator_client.get(f"{KEYS}{body['id']}/").json()
    listed = operator_client.get(KEYS).json()["results"]
    assert "key" not in detail
    assert all("key" not in k for k in listed)
    assert "key_hash" not in detail
    assert plaintext not in str(listed) + str(detail)
    assert selectors.api_key_authenticate(key=plaintext) == stored


def test_revoked_key_cannot_be_revoked_rotated_or_changed(
    operator_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme")
    key = operator_client.post(KEYS, {"tenant": "acme", "name": "prod"}).json()
    assert operator_client.post(f"{KEYS}{key['id']}/revoke/").status_code == 200
    assert selectors.api_key_authenticate(key=key["key"]) is None
    assert operator_client.post(f"{KEYS}{key['id']}/revoke/").status_code == 409
    assert operator_client.post(f"{KEYS}{key['id']}/rotate/", {}).status_code == 409
    assert operator_client.patch(f"{KEYS}{key['id']}/", {"name": "x"}).status_code == 409
    assert operator_client.get(KEYS, {"revoked": "true"}).json()["count"] == 1
    assert operator_client.get(KEYS, {"revoked": "false"}).json()["count"] == 0


def test_expired_key_stops_working(
    admin_user: User, operator_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    tenant = make_tenant("acme")
    soon = timezone.now() + timedelta(minutes=5)
    issued = services.api_key_create(actor=admin_user, tenant=tenant, name="t", expires_at=soon)
    assert selectors.api_key_authenticate(key=issued.plaintext) is not None
    after = soon + timedelta(seconds=1)
    assert selectors.api_key_authenticate(key=issued.plaintext, now=after) is None
    ApiKey.objects.filter(pk=issued.api_key.pk).update(expires_at=timezone.now())
    assert operator_client.get(f"{KEYS}{issued.api_key.pk}/").json()["status"] == "expired"
    assert operator_client.post(f"{KEYS}{issued.api_key.pk}/rotate/", {}).status_code == 409


def test_key_of_an_inactive_tenant_does_not_authenticate(
    admin_user: User, make_tenant: Callable[..., Tenant]
) -> None:
    tenant = make_tenant("acme")
    issued = services.api_key_create(actor=admin_user, tenant=tenant, name="t")
    services.tenant_deactivate(actor=admin_user, tenant=tenant)
    assert selectors.api_key_authenticate(key=issued.plaintext) is None
    assert selectors.api_key_authenticate(key="fi_nonsense") is None


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"tenant": "acme", "name": "k", "scopes": ["admin"]}, "scopes"),
        ({"tenant": "acme", "name": "k", "scopes": []}, "scopes"),
        ({"tenant": "acme", "name": "k", "scopes": "inference"}, "scopes"),
        ({"tenant": "acme", "name": "k", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"tenant": "acme", "name": "k", "expires_at": "tomorrow"}, "expires_at"),
        ({"tenant": "nobody", "name": "k"}, "tenant"),
        ({"tenant": "acme", "name": ""}, "name"),
        ({"tenant": "acme", "name": "k", "key_hash": "0" * 64}, "key_hash"),
        ({"tenant": "acme", "name": "k", "prefix": "fi_mine1234"}, "prefix"),
    ],
)
def test_bad_key_input_is_a_400_and_writes_nothing(
    operator_client: APIClient,
    make_tenant: Callable[..., Tenant],
    payload: dict[str, Any],
    field: str,
) -> None:
    make_tenant("acme")
    assert_refused_unchanged(operator_client, KEYS, payload, field)


def test_key_for_inactive_tenant_is_a_409(
    operator_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme", is_active=False)
    before = counts()
    assert operator_client.post(KEYS, {"tenant": "acme", "name": "k"}).status_code == 409
    assert counts() == before


def test_key_update_and_delete_are_audited(
    operator_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme")
    key = operator_client.post(KEYS, {"tenant": "acme", "name": "prod"}).json()
    changed = operator_client.patch(
        f"{KEYS}{key['id']}/", {"name": "Produktion ✓", "scopes": ["inference", "usage:read"]}
    )
    assert changed.status_code == 200, changed.content
    assert changed.json()["scopes"] == ["inference", "usage:read"]
    assert operator_client.delete(f"{KEYS}{key['id']}/").status_code == 204
    events = AuditEvent.objects.filter(object_type="tenancy.apikey").order_by("id")
    assert [e.action for e in events] == ["api_key.create", "api_key.update", "api_key.delete"]
    assert events[1].changes["name"] == ["prod", "Produktion ✓"]
