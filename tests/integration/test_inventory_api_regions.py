"""The inventory REST API for regions: CRUD with audit, strict validation (a 400, a 409 or
a 413 that writes nothing), the evacuate and restore actions, deletes refused while pools or
tenant residency policies still use a region, region links (upsert, filters, bad input) and
the read-only accelerator catalog."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.inventory.models import Region, RegionLink
from federation.tenancy.models import Tenant
from tests.integration.inventory_api_support import (  # noqa: F401  (fixture)
    API,
    actions_for,
    counts,
    fleet_fixture,
)
from tests.integration.inventory_factories import make_deployment, make_instance, make_region

pytestmark = pytest.mark.django_db


def region_body(**kw: Any) -> dict[str, Any]:
    return {
        "code": "eu-west",
        "name": "EU West",
        "provider": "cloud",
        "latitude": 53.3,
        "longitude": -6.3,
        "jurisdiction": "EU",
        **kw,
    }


def test_region_crud_with_audit(operator_client: APIClient, operator_user: User) -> None:
    created = operator_client.post(f"{API}/regions/", region_body(), format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["code"] == "eu-west"
    assert created.json()["status"] == "active"

    detail = operator_client.get(f"{API}/regions/eu-west/")
    assert detail.status_code == 200
    assert detail.json()["jurisdiction"] == "EU"

    # Free-text names take any unicode.
    patched = operator_client.patch(
        f"{API}/regions/eu-west/", {"name": "Éire — 都柏林"}, format="json"
    )
    assert patched.status_code == 200, patched.json()
    assert patched.json()["name"] == "Éire — 都柏林"

    region = Region.objects.get(code="eu-west")
    assert operator_client.delete(f"{API}/regions/eu-west/").status_code == 204
    assert not Region.objects.filter(code="eu-west").exists()
    events = AuditEvent.objects.filter(object_type="inventory.region", object_id=str(region.pk))
    assert sorted(e.action for e in events) == ["region.create", "region.delete", "region.update"]
    update = events.get(action="region.update")
    assert update.changes == {"name": ["EU West", "Éire — 都柏林"]}
    assert update.actor == operator_user


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        (region_body(code="東京"), "code", "lowercase letters"),
        (region_body(code="EU-WEST"), "code", "lowercase letters"),
        (region_body(latitude="north"), "latitude", "number is required"),
        (region_body(latitude=91), "latitude", "less than or equal to 90"),
        (region_body(latitude="45.0"), "latitude", "number is required"),
        (region_body(name=0), "name", "Not a valid string"),
        (region_body(name=["EU"]), "name", "Not a valid string"),
        (region_body(name="x\u0000"), "name", "Null characters are not allowed"),
        (region_body(name="x" * 101), "name", "no more than 100 characters"),
        (region_body(provider="mainframe"), "provider", "not a valid choice"),
        (region_body(colour="blue"), "colour", "Unknown field"),
        ({"code": "x"}, "name", "required"),
    ],
)
def test_region_bad_input_is_a_400_and_writes_nothing(
    admin_client: APIClient, body: dict[str, Any], field: str, text: str
) -> None:
    before = counts()
    response = admin_client.post(f"{API}/regions/", body, format="json")
    assert response.status_code == 400
    assert text in " ".join(response.json()[field])
    assert counts() == before


def test_malformed_json_is_a_400(admin_client: APIClient) -> None:
    response = admin_client.post(
        f"{API}/regions/", data='{"code": "x",', content_type="application/json"
    )
    assert response.status_code == 400
    assert "JSON parse error" in response.json()["detail"]


def test_oversized_body_is_a_413(admin_client: APIClient) -> None:
    huge = region_body(name="x" * 2_000_000)
    response = admin_client.post(f"{API}/regions/", huge, format="json")
    assert response.status_code == 413
    assert not Region.objects.exists()


def test_duplicate_region_code_is_a_409_conflict(
    admin_client: APIClient, fleet: dict[str, Any]
) -> None:
    before = Region.objects.count()
    response = admin_client.post(f"{API}/regions/", region_body(code="us-east"), format="json")
    assert response.status_code == 409
    assert Region.objects.count() == before
    assert "already exists" in response.json()["errors"]["code"][0]


def test_region_status_evacuated_only_through_the_action(
    admin_client: APIClient, fleet: dict[str, Any]
) -> None:
    response = admin_client.patch(f"{API}/regions/us-east/", {"status": "evacuated"}, format="json")
    assert response.status_code == 409
    assert "evacuate and restore actions" in response.json()["detail"]
    cordoned = admin_client.patch(f"{API}/regions/us-east/", {"status": "cordoned"}, format="json")
    assert cordoned.status_code == 200
    assert cordoned.json()["status"] == "cordoned"


def test_evacuate_drains_ready_instances_and_restore_undrains_only_those(
    admin_client: APIClient, fleet: dict[str, Any]
) -> None:
    dep = make_deployment(fleet["m8"], fleet["h100"], desired_replicas=3, max_replicas=3)
    serving = make_instance(dep, "i-serving", "ready")
    by_hand = make_instance(dep, "i-by-hand", "draining")
    loading = make_instance(dep, "i-loading", "loading")

    response = admin_client.post(f"{API}/regions/us-east/evacuate/")
    assert response.status_code == 200
    assert response.json()["status"] == "evacuated"
    serving.refresh_from_db()
    assert (serving.state, serving.drain_reason) == ("draining", "evacuation")
    event = AuditEvent.objects.get(action="region.evacuate")
    assert event.changes == {"status": ["active", "evacuated"], "drained_instances": ["i-serving"]}

    # Nothing in an evacuated region becomes ready, and nothing new is placed there.
    response = admin_client.post(f"{API}/instances/{serving.pk}/undrain/")
    assert response.status_code == 409
    assert "evacuated" in response.json()["detail"]
    response = admin_client.post(
        f"{API}/deployments/",
        {"model": fleet["m8"].pk, "pool": fleet["l4"].pk, "tensor_parallel_size": 1},
        format="json",
    )
    assert response.status_code == 409

    # Evacuating again changes nothing and records nothing.
    assert admin_client.post(f"{API}/regions/us-east/evacuate/").status_code == 200
    assert AuditEvent.objects.filter(action="region.evacuate").count() == 1

    response = admin_client.post(f"{API}/regions/us-east/restore/")
    assert response.status_code == 200
    assert response.json()["status"] == "active"
    states = {i.name: i.state for i in (serving, by_hand, loading) if not i.refresh_from_db()}
    assert states == {"i-serving": "ready", "i-by-hand": "draining", "i-loading": "loading"}


def test_region_delete_refused_while_used(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    response = admin_client.delete(f"{API}/regions/us-east/")
    assert response.status_code == 409
    assert response.json()["detail"] == "Cannot delete: still used by gpu pools."
    assert Region.objects.filter(code="us-east").exists()
    assert not AuditEvent.objects.filter(action="region.delete").exists()


def test_region_delete_refused_while_a_tenant_residency_names_it(
    admin_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    region = make_region("eu-west", "EU")
    make_tenant("acme").allowed_regions.add(region)
    response = admin_client.delete(f"{API}/regions/eu-west/")
    assert response.status_code == 409
    assert "residency policy of tenants acme" in response.json()["detail"]
    assert Region.objects.filter(code="eu-west").exists()


def test_region_links_upsert(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    make_region("eu-west", "EU")
    body = {"source": "us-east", "target": "eu-west", "rtt_ms": 80}
    created = admin_client.post(f"{API}/region-links/", body, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["source"] == "us-east"
    again = admin_client.post(f"{API}/region-links/", {**body, "rtt_ms": 75.5}, format="json")
    assert again.status_code == 200
    assert again.json()["rtt_ms"] == 75.5
    assert RegionLink.objects.count() == 1
    link = RegionLink.objects.get()
    assert actions_for(link) == ["region_link.update", "region_link.create"]

    patched = admin_client.patch(
        f"{API}/region-links/{link.pk}/", {"measured_rtt_ms": 71.0}, format="json"
    )
    assert patched.json()["measured_rtt_ms"] == 71.0
    listed = admin_client.get(f"{API}/region-links/", {"source": "us-east"})
    assert listed.json()["count"] == 1
    assert admin_client.get(f"{API}/region-links/", {"source": "eu-west"}).json()["count"] == 0
    assert admin_client.delete(f"{API}/region-links/{link.pk}/").status_code == 204
    assert not RegionLink.objects.exists()
    assert actions_for(link)[0] == "region_link.delete"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"source": "us-east", "target": "us-east", "rtt_ms": 1}, "target"),
        ({"source": "us-east", "target": "nowhere", "rtt_ms": 1}, "target"),
        ({"source": "us-east", "target": "eu-west", "rtt_ms": -5}, "rtt_ms"),
    ],
)
def test_region_link_bad_input(
    admin_client: APIClient, fleet: dict[str, Any], body: dict[str, Any], field: str
) -> None:
    make_region("eu-west", "EU")
    before = counts()
    response = admin_client.post(f"{API}/region-links/", body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert counts() == before


def test_accelerator_catalog_is_read_only(admin_client: APIClient) -> None:
    listed = admin_client.get(f"{API}/accelerator-types/", {"min_memory_gib": 80})
    names = {row["name"] for row in listed.json()["results"]}
    assert {"H100-80G", "H200-141G", "A100-80G"} <= names
    assert "L4-24G" not in names
    assert admin_client.post(f"{API}/accelerator-types/", {"name": "X"}).status_code == 405
