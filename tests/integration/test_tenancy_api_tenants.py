"""Tenants through the REST API (real PostgreSQL): create, read, change, deactivate and delete
with their data-residency policy (jurisdictions and regions), every refused input a 400 or
409 naming the field and writing nothing, and a lost race on the slug reported as the
duplicate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.inventory.models import Region
from federation.tenancy import services
from federation.tenancy.models import ApiKey, Tenant
from tests.integration.tenancy_api_support import (  # noqa: F401  (fixture)
    TENANTS,
    counts,
    regions_fixture,
)

pytestmark = pytest.mark.django_db


def errors_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert isinstance(body, dict), body
    return body


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


def test_slug_cannot_change(admin_client: APIClient, make_tenant: Callable[..., Tenant]) -> None:
    make_tenant("acme")
    response = admin_client.patch(f"{TENANTS}acme/", {"slug": "other"})
    assert response.status_code == 400
    assert errors_of(response) == {"slug": ["Unknown field."]}


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
