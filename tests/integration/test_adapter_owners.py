"""Adapters owned by a tenant, on the control plane: staff set the owner; a tenant viewer sees
public adapters and its own tenant's, never where any is stored (``source``), and another
tenant's is a 404; every region's table names the tenants that may use each private adapter.
The edge's side is ``test_edge_private_adapters.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from federation.inventory import services as inventory
from federation.inventory.models import LoraAdapter
from federation.routing.compiler import compile_fleet_tables
from federation.routing.selectors import fleet_snapshot
from federation.tenancy import services as tenancy
from federation.tenancy.models import Tenant
from regions.tables.schema import decode_table
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)

pytestmark = pytest.mark.django_db

API = "/api/v1/adapters/"


@pytest.fixture
def world(make_tenant: Callable[..., Tenant]) -> dict[str, Any]:
    """Two tenants; a public adapter and one private to acme, both on a ready deployment."""
    acme, globex = make_tenant("acme"), make_tenant("globex")
    model = make_model()
    public = inventory.adapter_create(
        actor=None, base_model=model, name="shared-lora", rank=8, source="s3://bucket/shared"
    )
    private = inventory.adapter_create(
        actor=None,
        base_model=model,
        name="acme-lora",
        rank=8,
        source="s3://acme-secret/lora",
        owner=acme,
    )
    for region in (make_region("us-east"), make_region("eu-west", "EU")):
        dep = make_deployment(model, make_pool(region), adapters=[public, private])
        make_instance(dep, f"{region.code}-1", "ready")
    return {"acme": acme, "globex": globex, "public": public, "private": private}


def test_a_tenant_viewer_sees_public_and_own_adapters_never_their_source(
    world: dict[str, Any],
    make_viewer: Callable[[Tenant], User],
    client_for: Callable[[User | None], APIClient],
) -> None:
    globex = client_for(make_viewer(world["globex"]))
    listed = globex.get(API)
    assert listed.status_code == 200
    assert [a["name"] for a in listed.json()["results"]] == ["shared-lora"]
    assert all("source" not in a for a in listed.json()["results"])
    assert b"s3://" not in listed.content
    # Another tenant's adapter does not exist for it: 404, as for an unknown id.
    assert globex.get(f"{API}{world['private'].pk}/").status_code == 404
    public = globex.get(f"{API}{world['public'].pk}/")
    assert public.status_code == 200 and "source" not in public.json()
    assert public.json()["owner"] is None

    acme = client_for(make_viewer(world["acme"]))
    own = acme.get(f"{API}{world['private'].pk}/")
    assert own.status_code == 200 and own.json()["owner"] == "acme"
    assert "source" not in own.json()
    assert {a["name"] for a in acme.get(API).json()["results"]} == {"acme-lora", "shared-lora"}
    assert b"s3://" not in acme.get(API).content

    # A usage:read key reads its tenant's usage, not the catalog.
    usage_key = tenancy.api_key_create(
        actor=None, tenant=world["globex"], name="reports", scopes=["usage:read"]
    ).plaintext
    by_key = APIClient().get(API, HTTP_AUTHORIZATION=f"Bearer {usage_key}")
    assert by_key.status_code in (401, 403) and b"acme-lora" not in by_key.content


def test_staff_set_and_see_the_owner_and_the_source(
    world: dict[str, Any], admin_client: APIClient
) -> None:
    listed = admin_client.get(API).json()["results"]
    by_name = {a["name"]: a for a in listed}
    assert by_name["acme-lora"]["owner"] == "acme"
    assert by_name["acme-lora"]["source"] == "s3://acme-secret/lora"
    body = {
        "base_model": world["public"].base_model_id,
        "name": "globex-lora",
        "rank": 4,
        "source": "/models/globex",
        "owner": "globex",
    }
    created = admin_client.post(API, body, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["owner"] == "globex"
    assert LoraAdapter.objects.get(name="globex-lora").owner == world["globex"]
    unknown = admin_client.post(API, {**body, "name": "x-lora", "owner": "nobody"}, format="json")
    assert unknown.status_code == 400 and "owner" in unknown.json()
    made_public = admin_client.patch(f"{API}{created.json()['id']}/", {"owner": None})
    assert made_public.status_code == 200 and made_public.json()["owner"] is None


def test_every_regions_table_names_who_may_use_each_private_adapter(
    world: dict[str, Any],
) -> None:
    snapshot = fleet_snapshot()
    tables = compile_fleet_tables(snapshot, versions={"us-east": 1, "eu-west": 1}, generated_at="x")
    for doc in tables.values():
        assert doc["private_adapters"] == {"acme-lora": ["acme"]}
        table = decode_table(orjson.dumps(doc))
        assert table.private_adapters == {"acme-lora": ("acme",)}
        assert {"acme-lora", "shared-lora"} <= {a for i in table.instances for a in i.adapters}
    # Made public: no longer listed, and the table keeps its older schema.
    inventory.adapter_update(actor=None, adapter=world["private"], data={"owner": None})
    tables = compile_fleet_tables(
        fleet_snapshot(), versions={"us-east": 2, "eu-west": 2}, generated_at="x"
    )
    assert all("private_adapters" not in doc for doc in tables.values())
