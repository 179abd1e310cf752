"""API key rotation and key budgets through the REST API (real PostgreSQL): a rotation issues
a new secret, with an optional grace period for the old one; a key's monthly budget is set,
changed, kept across rotations and budgeted under every live prefix; bad budgets and grace
periods are refused; the published key table follows the same rules as authentication."""

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
from tests.integration.tenancy_api_support import KEYS

pytestmark = pytest.mark.django_db


def test_rotate_issues_a_new_secret_and_the_old_one_stops_working(
    operator_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme")
    old = operator_client.post(KEYS, {"tenant": "acme", "name": "prod"}).json()
    rotated = operator_client.post(f"{KEYS}{old['id']}/rotate/", {})
    assert rotated.status_code == 200, rotated.content
    new = rotated.json()
    assert new["id"] == old["id"]
    assert new["key"] != old["key"]
    assert new["prefix"] != old["prefix"]
    assert selectors.api_key_authenticate(key=old["key"]) is None
    assert selectors.api_key_authenticate(key=new["key"]).pk == old["id"]
    assert "key" not in operator_client.get(f"{KEYS}{old['id']}/").json()
    assert AuditEvent.objects.filter(action="api_key.rotate", object_id=str(old["id"])).count() == 1


def test_rotate_with_grace_keeps_the_old_secret_until_the_grace_ends(
    operator_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme")
    old = operator_client.post(KEYS, {"tenant": "acme", "name": "prod"}).json()
    new = operator_client.post(f"{KEYS}{old['id']}/rotate/", {"grace_seconds": 300}).json()
    now = timezone.now()
    assert selectors.api_key_authenticate(key=old["key"], now=now) is not None
    assert selectors.api_key_authenticate(key=new["key"], now=now) is not None
    later = now + timedelta(seconds=301)
    assert selectors.api_key_authenticate(key=old["key"], now=later) is None
    assert selectors.api_key_authenticate(key=new["key"], now=later) is not None

    revoked = operator_client.post(f"{KEYS}{old['id']}/revoke/")
    assert revoked.status_code == 200
    assert revoked.json()["status"] == "revoked"
    assert selectors.api_key_authenticate(key=old["key"], now=now) is None
    assert selectors.api_key_authenticate(key=new["key"], now=now) is None


def test_a_key_budget_is_set_read_changed_and_kept_across_rotations(
    operator_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme")
    key = operator_client.post(
        KEYS, {"tenant": "acme", "name": "batch", "monthly_budget_usd": "12.50"}, format="json"
    ).json()
    assert key["monthly_budget_usd"] == "12.50"
    assert operator_client.get(f"{KEYS}{key['id']}/").json()["monthly_budget_usd"] == "12.50"
    changed = operator_client.patch(
        f"{KEYS}{key['id']}/", {"monthly_budget_usd": 40}, format="json"
    )
    assert changed.status_code == 200, changed.content
    assert changed.json()["monthly_budget_usd"] == "40.00"
    audit = AuditEvent.objects.filter(action="api_key.update", object_id=str(key["id"])).get()
    assert "monthly_budget_usd" in audit.changes

    first = key["prefix"]
    second = operator_client.post(f"{KEYS}{key['id']}/rotate/", {"grace_seconds": 60}).json()
    third = operator_client.post(f"{KEYS}{key['id']}/rotate/", {}).json()
    assert third["monthly_budget_usd"] == "40.00"
    # Every prefix it had stays the key's (its spend under them is its spend).
    stored = ApiKey.objects.get(pk=key["id"])
    assert set(stored.prefixes.values_list("prefix", flat=True)) == {
        first,
        second["prefix"],
        third["prefix"],
    }
    # Rotated without grace: only the current prefix is sent by a usable secret.
    [budget] = selectors.api_key_budgets(now=timezone.now())
    assert budget.live == (third["prefix"],)
    assert set(budget.prefixes) == {first, second["prefix"], third["prefix"]}

    cleared = operator_client.patch(
        f"{KEYS}{key['id']}/", {"monthly_budget_usd": None}, format="json"
    )
    assert cleared.json()["monthly_budget_usd"] is None
    assert selectors.api_key_budgets(now=timezone.now()) == []


def test_a_key_in_rotation_grace_is_budgeted_under_both_prefixes(
    operator_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme")
    key = operator_client.post(
        KEYS, {"tenant": "acme", "name": "k", "monthly_budget_usd": "5"}, format="json"
    ).json()
    new = operator_client.post(f"{KEYS}{key['id']}/rotate/", {"grace_seconds": 300}).json()
    now = timezone.now()
    [budget] = selectors.api_key_budgets(now=now)
    assert budget.live == (new["prefix"], key["prefix"])
    [later] = selectors.api_key_budgets(now=now + timedelta(seconds=301))
    assert later.live == (new["prefix"],)


@pytest.mark.parametrize("budget", [-1, "-0.01", "lots", "1.005", True, 10**13])
def test_a_bad_key_budget_is_refused(
    operator_client: APIClient, make_tenant: Callable[..., Tenant], budget: Any
) -> None:
    make_tenant("acme")
    created = operator_client.post(
        KEYS, {"tenant": "acme", "name": "k", "monthly_budget_usd": budget}, format="json"
    )
    assert created.status_code == 400
    assert "monthly_budget_usd" in created.json()
    key = operator_client.post(KEYS, {"tenant": "acme", "name": "k2"}).json()
    patched = operator_client.patch(
        f"{KEYS}{key['id']}/", {"monthly_budget_usd": budget}, format="json"
    )
    assert patched.status_code == 400
    assert ApiKey.objects.get(pk=key["id"]).monthly_budget_usd is None


@pytest.mark.parametrize("grace", [-1, 86401, "soon", "60", None])
def test_rotate_refuses_bad_grace(
    operator_client: APIClient, make_tenant: Callable[..., Tenant], grace: Any
) -> None:
    make_tenant("acme")
    key = operator_client.post(KEYS, {"tenant": "acme", "name": "prod"}).json()
    response = operator_client.post(f"{KEYS}{key['id']}/rotate/", {"grace_seconds": grace})
    assert response.status_code == 400
    assert "grace_seconds" in response.json()
    assert selectors.api_key_authenticate(key=key["key"]) is not None


def test_key_table_entries_follow_the_same_rules_as_authentication(
    admin_user: User, make_tenant: Callable[..., Tenant]
) -> None:
    acme, dormant = make_tenant("acme"), make_tenant("dormant")
    plain = services.api_key_create(actor=admin_user, tenant=acme, name="plain")
    rotated = services.api_key_create(actor=admin_user, tenant=acme, name="rotated")
    revoked = services.api_key_create(actor=admin_user, tenant=acme, name="revoked")
    asleep = services.api_key_create(actor=admin_user, tenant=dormant, name="asleep")
    services.api_key_revoke(actor=admin_user, api_key=revoked.api_key)
    services.tenant_deactivate(actor=admin_user, tenant=dormant)
    new = services.api_key_rotate(actor=admin_user, api_key=rotated.api_key, grace_seconds=60)

    now = timezone.now()
    entries = selectors.api_key_table_entries(now=now)
    published = {e.key_hash for e in entries}
    for plaintext in [plain.plaintext, rotated.plaintext, new.plaintext, revoked.plaintext]:
        authenticated = selectors.api_key_authenticate(key=plaintext, now=now) is not None
        assert (hash_key(plaintext) in published) == authenticated
    assert hash_key(asleep.plaintext) not in published
    grace_entry = next(e for e in entries if e.key_hash == hash_key(rotated.plaintext))
    assert grace_entry.valid_until is not None
    assert grace_entry.valid_until <= now + timedelta(seconds=60)
    later = {e.key_hash for e in selectors.api_key_table_entries(now=now + timedelta(seconds=61))}
    assert hash_key(rotated.plaintext) not in later
    assert hash_key(new.plaintext) in later
