"""Tenants, API keys, users and the audit trail through the REST API (real PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.inventory.models import Region
from federation.tenancy import selectors, services
from federation.tenancy.keys import hash_key
from federation.tenancy.models import ApiKey, Membership, Tenant

pytestmark = pytest.mark.django_db

TENANTS = "/api/v1/tenants/"
KEYS = "/api/v1/api-keys/"
USERS = "/api/v1/users/"
AUDIT = "/api/v1/audit-events/"


@pytest.fixture
def regions(db: None) -> dict[str, Region]:
    specs = [("us-east", "US", 39.0, -77.5), ("eu-west", "EU", 53.3, -6.3)]
    specs.append(("eu-central", "EU", 50.1, 8.7))
    return {
        code: Region.objects.create(
            code=code, name=code, provider="cloud", latitude=lat, longitude=lon, jurisdiction=j
        )
        for code, j, lat, lon in specs
    }


def counts() -> tuple[int, ...]:
    return (
        Tenant.objects.count(),
        Tenant.allowed_regions.through.objects.count(),
        ApiKey.objects.count(),
        User.objects.count(),
        Membership.objects.count(),
        AuditEvent.objects.count(),
    )


def errors_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert isinstance(body, dict), body
    return body


# --- tenants --------------------------------------------------------------------------------


def test_tenant_crud_with_residency(admin_client: APIClient, regions: dict[str, Region]) -> None:
    created = admin_client.post(
        TENANTS,
        {
            "slug": "acme",
            "name": "Acme GmbH — Zürich",
            "allowed_jurisdictions": ["EU"],
            "allowed_regions": ["eu-west"],
            "requests_per_minute": 600,
            "monthly_budget_usd": "1500.00",
        },
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["name"] == "Acme GmbH — Zürich"
    assert body["allowed_regions"] == ["eu-west"]
    assert body["permitted_regions"] == ["eu-west"]
    assert body["tokens_per_minute"] is None

    detail = admin_client.get(f"{TENANTS}acme/")
    assert detail.json() == body

    changed = admin_client.patch(f"{TENANTS}acme/", {"allowed_regions": [], "tokens_per_minute": 5})
    assert changed.status_code == 200, changed.content
    assert changed.json()["permitted_regions"] == ["eu-central", "eu-west"]
    assert changed.json()["tokens_per_minute"] == 5

    assert admin_client.post(f"{TENANTS}acme/deactivate/").json()["is_active"] is False
    assert admin_client.post(f"{TENANTS}acme/deactivate/").status_code == 409
    assert admin_client.get(TENANTS, {"is_active": "false"}).json()["count"] == 1
    assert admin_client.post(f"{TENANTS}acme/activate/").json()["is_active"] is True

    assert admin_client.delete(f"{TENANTS}acme/").status_code == 204
    assert admin_client.get(f"{TENANTS}acme/").status_code == 404
    actions = list(
        AuditEvent.objects.filter(object_type="tenancy.tenant").values_list("action", flat=True)
    )
    assert sorted(actions) == sorted(
        ["tenant.create", "tenant.update", "tenant.deactivate", "tenant.activate", "tenant.delete"]
    )
    assert set(AuditEvent.objects.values_list("actor_repr", flat=True)) == {"alice-admin"}


def test_filter_tenants_by_jurisdiction(
    operator_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("eu-only", allowed_jurisdictions=["EU"])
    make_tenant("anywhere")
    make_tenant("eu-uk", allowed_jurisdictions=["EU", "UK"])
    listed = operator_client.get(TENANTS, {"jurisdiction": "EU"}).json()
    assert [t["slug"] for t in listed["results"]] == ["eu-only", "eu-uk"]
    assert operator_client.get(TENANTS, {"jurisdiction": "MARS"}).status_code == 400


def test_region_outside_allowed_jurisdictions_is_a_400_naming_it(
    admin_client: APIClient, regions: dict[str, Region]
) -> None:
    before = counts()
    response = admin_client.post(
        TENANTS,
        {
            "slug": "acme",
            "name": "Acme",
            "allowed_jurisdictions": ["EU"],
            "allowed_regions": ["us-east"],
        },
    )
    assert response.status_code == 400
    assert errors_of(response)["allowed_regions"] == [
        "region us-east is in US, outside the allowed jurisdictions [EU]"
    ]
    assert counts() == before


def test_residency_is_checked_on_update_against_the_stored_policy(
    admin_client: APIClient, regions: dict[str, Region], make_tenant: Callable[..., Tenant]
) -> None:
    tenant = make_tenant("acme", allowed_jurisdictions=["EU"])
    tenant.allowed_regions.set([regions["eu-west"]])
    response = admin_client.patch(f"{TENANTS}acme/", {"allowed_jurisdictions": ["US"]})
    assert response.status_code == 400
    assert "eu-west is in EU" in errors_of(response)["allowed_regions"][0]
    tenant.refresh_from_db()
    assert tenant.allowed_jurisdictions == ["EU"]


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"slug": "Ünïcode", "name": "x"}, "slug"),
        ({"slug": "has space", "name": "x"}, "slug"),
        ({"slug": "-edge", "name": "x"}, "slug"),
        ({"slug": "ok", "name": ""}, "name"),
        ({"slug": "ok", "name": "x", "requests_per_minute": -5}, "requests_per_minute"),
        ({"slug": "ok", "name": "x", "requests_per_minute": 0}, "requests_per_minute"),
        ({"slug": "ok", "name": "x", "tokens_per_minute": "lots"}, "tokens_per_minute"),
        ({"slug": "ok", "name": "x", "tokens_per_minute": 2**40}, "tokens_per_minute"),
        ({"slug": "ok", "name": "x", "monthly_budget_usd": "-1"}, "monthly_budget_usd"),
        # blank is not null, nor is an amount with spaces or an exponent one (the API fuzzer)
        ({"slug": "ok", "name": "x", "monthly_budget_usd": ""}, "monthly_budget_usd"),
        ({"slug": "ok", "name": "x", "monthly_budget_usd": " 12 "}, "monthly_budget_usd"),
        ({"slug": "ok", "name": "x", "monthly_budget_usd": "1E2"}, "monthly_budget_usd"),
        ({"slug": "ok", "name": "x", "allowed_jurisdictions": "EU"}, "allowed_jurisdictions"),
        ({"slug": "ok", "name": "x", "allowed_jurisdictions": ["eu"]}, "allowed_jurisdictions"),
        ({"slug": "ok", "name": "x", "allowed_regions": ["mars-1"]}, "allowed_regions"),
        ({"slug": "ok", "name": "x", "allowed_regions": ["eu\x00west"]}, "allowed_regions"),
        # an object is not a list of its keys, a number not a code (the API fuzzer)
        ({"slug": "ok", "name": "x", "allowed_regions": {"eu-west": 1}}, "allowed_regions"),
        ({"slug": "ok", "name": "x", "allowed_regions": [{"code": "eu-west"}]}, "allowed_regions"),
        ({"slug": "ok", "name": "x", "is_active": "perhaps"}, "is_active"),
        ({"slug": "ok", "name": "x", "is_active": 0}, "is_active"),
        ({"slug": "ok", "name": "x", "requests_per_minute": "600"}, "requests_per_minute"),
        ({"slug": "ok", "name": "x", "requests_per_minute": 6.5}, "requests_per_minute"),
        ({"slug": "ok", "name": "x", "requests_per_minute": True}, "requests_per_minute"),
        ({"slug": "ok", "name": "x", "rpm": 10}, "rpm"),
        ({"slug": 7, "name": ["x"]}, "name"),
        ({"slug": "ok", "name": 0}, "name"),
        ({"name": "x"}, "slug"),
    ],
)
def test_bad_tenant_input_is_a_400_naming_the_field_and_writes_nothing(
    admin_client: APIClient, regions: dict[str, Region], payload: dict[str, Any], field: str
) -> None:
    before = counts()
    response = admin_client.post(TENANTS, payload)
    assert response.status_code == 400, response.content
    assert field in errors_of(response)
    assert counts() == before


def test_a_region_is_named_by_its_code_as_a_string(
    admin_client: APIClient, regions: dict[str, Region]
) -> None:
    """A number is not the code it spells (the API fuzzer's region ``0``)."""
    Region.objects.create(
        code="7", name="seven", provider="cloud", latitude=0, longitude=0, jurisdiction="EU"
    )
    before = counts()
    response = admin_client.post(
        TENANTS, {"slug": "ok", "name": "x", "allowed_regions": [7]}, format="json"
    )
    assert response.status_code == 400, response.content
    assert "allowed_regions" in errors_of(response)
    assert counts() == before
    ok = {"slug": "ok", "name": "x", "allowed_regions": ["7"]}
    assert admin_client.post(TENANTS, ok, format="json").status_code == 201


def test_duplicate_slug_is_a_409_conflict(
    admin_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme")
    response = admin_client.post(TENANTS, {"slug": "acme", "name": "Again"})
    assert response.status_code == 409
    assert "slug" in errors_of(response)["errors"]


def test_duplicate_username_is_a_409_and_writes_nothing(admin_client: APIClient) -> None:
    before = counts()
    response = admin_client.post(
        USERS, {"username": "alice-admin", "password": "correct-horse-battery", "role": "admin"}
    )
    assert response.status_code == 409
    assert "username" in response.json()["errors"]
    assert counts() == before


def test_slug_cannot_change(admin_client: APIClient, make_tenant: Callable[..., Tenant]) -> None:
    make_tenant("acme")
    response = admin_client.patch(f"{TENANTS}acme/", {"slug": "other"})
    assert response.status_code == 400
    assert errors_of(response) == {"slug": ["Unknown field."]}


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"slug": "acme", "name": ', "application/json"),
        (b"\xff\xfe not utf-8", "application/json"),
        (b"[1, 2, 3]", "application/json"),
        (b'"just a string"', "application/json"),
        (b"slug=acme&name=Acme", "application/x-www-form-urlencoded"),
    ],
)
def test_malformed_bodies_are_4xx_and_write_nothing(
    admin_client: APIClient, body: bytes, content_type: str
) -> None:
    before = counts()
    response = admin_client.generic("POST", TENANTS, body, content_type=content_type)
    assert response.status_code in {400, 415}, response.content
    assert counts() == before


def test_huge_payload_is_a_413_and_writes_nothing(admin_client: APIClient, settings: Any) -> None:
    before = counts()
    huge = b'{"slug": "acme", "name": "' + b"x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1) + b'"}'
    response = admin_client.generic("POST", TENANTS, huge, content_type="application/json")
    assert response.status_code == 413
    assert response.json()["code"] == "payload_too_large"
    assert counts() == before


def test_tenant_with_active_keys_cannot_be_deleted(
    admin_client: APIClient, admin_user: User, make_tenant: Callable[..., Tenant]
) -> None:
    tenant = make_tenant("acme")
    issued = services.api_key_create(actor=admin_user, tenant=tenant, name="prod")
    response = admin_client.delete(f"{TENANTS}acme/")
    assert response.status_code == 409
    assert issued.api_key.prefix in response.json()["detail"]
    services.api_key_revoke(actor=admin_user, api_key=issued.api_key)
    assert admin_client.delete(f"{TENANTS}acme/").status_code == 204
    assert not ApiKey.objects.exists()


# --- API keys -------------------------------------------------------------------------------


def all_stored_text() -> str:
    """Every text column of every tenancy and audit row, to search for a leaked secret."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT row_to_json(k)::text FROM tenancy_apikey k "
            "UNION ALL SELECT row_to_json(a)::text FROM core_auditevent a"
        )
        return "\n".join(row[0] for row in cursor.fetchall())


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
    before = counts()
    response = operator_client.post(KEYS, payload)
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert counts() == before


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


# --- users ----------------------------------------------------------------------------------


def test_admin_manages_users_and_roles(
    admin_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme")
    created = admin_client.post(
        USERS,
        {
            "username": "vera",
            "email": "vera@example.com",
            "password": "correct-horse-battery",
            "role": "tenant_viewer",
            "tenant": "acme",
        },
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["role"] == "tenant_viewer"
    assert body["tenant"] == "acme"
    assert "password" not in body
    user = User.objects.get(username="vera")
    assert user.check_password("correct-horse-battery")
    assert "correct-horse-battery" not in user.password

    promoted = admin_client.patch(f"{USERS}{user.pk}/", {"role": "operator"})
    assert promoted.status_code == 200, promoted.content
    assert promoted.json()["role"] == "operator"
    assert promoted.json()["tenant"] is None

    assert admin_client.get(USERS, {"role": "operator"}).json()["count"] == 1
    assert admin_client.delete(f"{USERS}{user.pk}/").status_code == 204
    actions = AuditEvent.objects.filter(object_type="auth.user").values_list("action", flat=True)
    assert sorted(actions) == ["user.create", "user.delete", "user.update"]
    assert "correct-horse-battery" not in all_stored_text()


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"username": "v", "password": "short", "role": "operator"}, "password"),
        ({"username": "v", "password": "password", "role": "operator"}, "password"),
        ({"username": "v", "password": "correct-horse-battery", "role": "god"}, "role"),
        ({"username": "v", "password": "correct-horse-battery", "role": "tenant_viewer"}, "tenant"),
        (
            {
                "username": "v",
                "password": "correct-horse-battery",
                "role": "admin",
                "tenant": "acme",
            },
            "tenant",
        ),
        ({"username": "a b!", "password": "correct-horse-battery", "role": "admin"}, "username"),
        # An empty reference is not "no tenant" (DRF reads "" as null for related fields).
        (
            {"username": "v", "password": "correct-horse-battery", "role": "admin", "tenant": ""},
            "tenant",
        ),
        (
            {"username": "v", "password": "correct-horse-battery", "role": "admin", "email": "no"},
            "email",
        ),
        (
            {
                "username": "v",
                "password": "correct-horse-battery",
                "role": "admin",
                "is_staff": True,
            },
            "is_staff",
        ),
    ],
)
def test_bad_user_input_is_a_400_and_writes_nothing(
    admin_client: APIClient,
    make_tenant: Callable[..., Tenant],
    payload: dict[str, Any],
    field: str,
) -> None:
    make_tenant("acme")
    before = counts()
    response = admin_client.post(USERS, payload)
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert counts() == before


def test_admin_cannot_demote_deactivate_or_delete_itself(
    admin_client: APIClient, admin_user: User
) -> None:
    url = f"{USERS}{admin_user.pk}/"
    assert admin_client.patch(url, {"role": "operator"}).status_code == 409
    assert admin_client.patch(url, {"is_active": False}).status_code == 409
    assert admin_client.delete(url).status_code == 409


def test_password_change_revokes_the_users_token(
    admin_client: APIClient, operator_user: User, client_for: Callable[[User | None], APIClient]
) -> None:
    operator = client_for(operator_user)
    assert operator.get(TENANTS).status_code == 200
    changed = admin_client.patch(f"{USERS}{operator_user.pk}/", {"password": "another-long-secret"})
    assert changed.status_code == 200
    assert operator.get(TENANTS).status_code == 401
    event = AuditEvent.objects.get(action="user.update")
    assert event.changes == {"password": "changed"}


def test_operator_cannot_manage_users(operator_client: APIClient, admin_user: User) -> None:
    assert operator_client.get(USERS).status_code == 403
    assert operator_client.get(f"{USERS}{admin_user.pk}/").status_code == 403
    response = operator_client.post(
        USERS, {"username": "x", "password": "correct-horse-battery", "role": "admin"}
    )
    assert response.status_code == 403


# --- audit trail ----------------------------------------------------------------------------


def test_audit_events_are_filterable(
    admin_client: APIClient, operator_client: APIClient, regions: dict[str, Region]
) -> None:
    start = timezone.now()
    admin_client.post(TENANTS, {"slug": "acme", "name": "Acme"})
    operator_client.patch(f"{TENANTS}acme/", {"name": "Acme Inc"})
    tenant_id = str(Tenant.objects.get(slug="acme").pk)

    def listed(**params: str) -> list[dict[str, Any]]:
        response = operator_client.get(AUDIT, params)
        assert response.status_code == 200, response.content
        return list(response.json()["results"])

    everything = listed(object_type="tenancy.tenant", object_id=tenant_id)
    assert [e["action"] for e in everything] == ["tenant.update", "tenant.create"]
    assert everything[0]["changes"] == {"name": ["Acme", "Acme Inc"]}
    assert [e["actor"] for e in listed(actor="oscar-operator")] == ["oscar-operator"]
    assert len(listed(action="tenant.create")) == 1
    assert len(listed(created_after=start.isoformat())) == 2
    assert listed(created_before=start.isoformat()) == []
    detail = operator_client.get(f"{AUDIT}{everything[1]['id']}/").json()
    assert detail["object_repr"] == "acme"
    assert operator_client.get(AUDIT, {"created_after": "yesterday"}).status_code == 400
    assert operator_client.delete(f"{AUDIT}{everything[1]['id']}/").status_code == 405


# --- corners found by fuzzing: each a clear 4xx, never a database error ----------------------


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/tenants/%00acme/",
        "/api/v1/tenants/%C2%84/deactivate/",
        "/api/v1/api-keys/99999999999999999999999/",
        "/api/v1/api-keys/abc/",
        "/api/v1/audit-events/-1/",
    ],
)
def test_impossible_lookups_are_json_404s(admin_client: APIClient, path: str) -> None:
    response = admin_client.get(path) if "deactivate" not in path else admin_client.post(path)
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"


@pytest.mark.parametrize(
    "when",
    ["2999-01-01T00:00:00-21:26", "9999-12-31T23:59:59-10:00", "0001-01-01T00:00:00+05:00"],
)
def test_datetimes_postgres_cannot_store_are_400s(
    operator_client: APIClient, make_tenant: Callable[..., Tenant], when: str
) -> None:
    make_tenant("acme")
    created = operator_client.post(KEYS, {"tenant": "acme", "name": "k", "expires_at": when})
    if when.startswith("2999"):
        # an offset PostgreSQL refuses is converted to UTC, so the key is stored
        assert created.status_code == 201, created.content
        assert created.json()["expires_at"] == "2999-01-01T21:26:00Z"
    else:
        assert created.status_code == 400
        assert "expires_at" in created.json()
    listed = operator_client.get(AUDIT, {"created_after": when, "created_before": when})
    if when.startswith("2999"):
        assert listed.json()["count"] == 0
    else:
        assert listed.status_code == 400


def test_schema_says_strict_inputs_refuse_unknown_fields(admin_client: APIClient) -> None:
    schema = admin_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    components = schema["components"]["schemas"]
    for name in ["TenantCreateInputRequest", "ApiKeyCreateInputRequest", "UserCreateInputRequest"]:
        assert components[name]["additionalProperties"] is False, name
    # outputs stay open: adding a field later is not a breaking change
    assert "additionalProperties" not in components["TenantOutput"]


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


@pytest.mark.parametrize("url", [TENANTS, KEYS, USERS])
def test_lists_take_a_fixed_number_of_queries(
    admin_client: APIClient,
    admin_user: User,
    make_tenant: Callable[..., Tenant],
    regions: dict[str, Region],
    django_assert_max_num_queries: Any,
    url: str,
) -> None:
    """No N+1: 12 rows cost what 1 row costs."""

    def add(i: int) -> None:
        tenant = make_tenant(f"t{i}", allowed_jurisdictions=["EU"])
        tenant.allowed_regions.set([regions["eu-west"]])
        services.api_key_create(actor=admin_user, tenant=tenant, name=f"k{i}")
        services.user_create(
            actor=admin_user,
            username=f"u{i}",
            password="long-enough-pw-1",
            role="tenant_viewer",
            tenant=tenant,
        )

    add(0)
    with CaptureQueriesContext(connection) as one:
        assert admin_client.get(url).status_code == 200
    for i in range(1, 12):
        add(i)
    with django_assert_max_num_queries(len(one.captured_queries)):
        assert admin_client.get(url).json()["count"] >= 12


# --- Django admin -----------------------------------------------------------------------------


@pytest.fixture
def admin_site(db: None) -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw-root-12345"))
    return client


def test_admin_lists_tenancy_and_audit_without_key_material(
    admin_site: Client, admin_user: User, make_tenant: Callable[..., Tenant]
) -> None:
    issued = services.api_key_create(actor=admin_user, tenant=make_tenant("acme"), name="prod")
    for model in ["tenancy/tenant", "tenancy/apikey", "tenancy/membership", "core/auditevent"]:
        assert admin_site.get(f"/admin/{model}/").status_code == 200, model
    page = admin_site.get(f"/admin/tenancy/apikey/{issued.api_key.pk}/change/")
    assert page.status_code == 200
    assert issued.api_key.key_hash.encode() not in page.content
    assert issued.api_key.prefix.encode() in page.content
    event = AuditEvent.objects.first()
    assert event is not None
    assert (
        admin_site.post(f"/admin/core/auditevent/{event.pk}/delete/", {"post": "yes"}).status_code
        == 403
    )
    assert AuditEvent.objects.filter(pk=event.pk).exists()


def test_admin_tenant_edits_are_validated_and_audited(
    admin_site: Client, regions: dict[str, Region]
) -> None:
    form = {
        "slug": "acme",
        "name": "Acme",
        "allowed_jurisdictions": '["EU"]',
        "allowed_regions": [str(regions["us-east"].pk)],
        "requests_per_minute": "",
        "tokens_per_minute": "",
        "monthly_budget_usd": "",
        "is_active": "on",
    }
    refused = admin_site.post("/admin/tenancy/tenant/add/", form)
    assert refused.status_code == 200  # the form again, with the error
    assert b"region us-east is in US, outside the allowed jurisdictions [EU]" in refused.content
    assert not Tenant.objects.exists()

    form["allowed_regions"] = [str(regions["eu-west"].pk)]
    assert admin_site.post("/admin/tenancy/tenant/add/", form).status_code == 302
    tenant = Tenant.objects.get(slug="acme")
    assert list(tenant.allowed_regions.values_list("code", flat=True)) == ["eu-west"]
    event = AuditEvent.objects.get(action="tenant.create")
    assert event.actor_repr == "root"
    assert event.changes["allowed_regions"] == ["eu-west"]


def test_losing_a_race_on_the_slug_is_the_duplicate_not_a_500(
    admin_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another request inserts the same slug between our check and our insert: the answer is
    the duplicate the check reports (409 ``duplicate`` through the API)."""
    Tenant.objects.create(slug="acme", name="The winner")
    monkeypatch.setattr(Tenant, "full_clean", lambda self, **kwargs: None)
    with pytest.raises(ValidationError) as raised:
        services.tenant_create(actor=admin_user, slug="acme", name="The loser")
    assert raised.value.message_dict == {"slug": ["Tenant with this Slug already exists."]}
    assert [e.code for e in raised.value.error_dict["slug"]] == ["unique"]
    assert Tenant.objects.get().name == "The winner"
    assert not AuditEvent.objects.exists()


def test_schema_marks_every_nullable_output_field_nullable(admin_client: APIClient) -> None:
    """A null in a response must be allowed by the schema (found by schemathesis)."""
    schema = admin_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    components = schema["components"]["schemas"]
    expected = {
        "TenantOutput": ["requests_per_minute", "tokens_per_minute", "monthly_budget_usd"],
        "ApiKeyOutput": [
            "expires_at",
            "revoked_at",
            "last_used_at",
            "previous_secret_valid_until",
            "created_by",
        ],
        "UserOutput": ["role", "tenant", "last_login"],
        "MeOutput": ["role", "tenant"],
    }
    for component, fields in expected.items():
        properties = components[component]["properties"]
        for field in fields:
            assert properties[field].get("nullable") is True, (component, field)


@pytest.mark.parametrize(
    ("url", "query"),
    [
        (TENANTS, "is_active=null"),
        (TENANTS, "is_active=perhaps"),
        (KEYS, "revoked=maybe"),
        (USERS, "is_active=2"),
        (AUDIT, "created_after=not-a-date"),
        (TENANTS, "offset=-1"),
    ],
)
def test_malformed_filters_are_400s_not_ignored(
    admin_client: APIClient, url: str, query: str
) -> None:
    assert admin_client.get(f"{url}?{query}").status_code == 400
