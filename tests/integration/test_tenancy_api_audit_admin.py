"""The audit trail and the Django admin for tenancy (real PostgreSQL): audit events listed and
filtered through the REST API and never deleted; the admin lists tenancy and audit rows
without key material, refuses to delete an audit event, and validates and audits tenant
edits like the API does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.inventory.models import Region
from federation.tenancy import services
from federation.tenancy.models import Tenant
from tests.integration.tenancy_api_support import (  # noqa: F401  (fixture)
    AUDIT,
    TENANTS,
    regions_fixture,
)

pytestmark = pytest.mark.django_db


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
