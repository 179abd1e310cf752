"""What holds across every inventory resource of the REST API: a tenant viewer reads the
catalog but never the fleet or its actions and writes neither, anonymous callers are
refused, every list answers in a bounded number of queries however many rows there are, and
the OpenAPI schema documents the error responses and the strict request bodies."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from federation.inventory import services
from federation.inventory.models import Deployment, LoraAdapter
from federation.tenancy.models import Tenant
from tests.integration.inventory_api_support import (  # noqa: F401  (fixture)
    API,
    deployment_fixture,
    fleet_fixture,
)
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_pool,
    make_region,
)

pytestmark = pytest.mark.django_db


# --- permissions ---------------------------------------------------------------------------

STAFF_ONLY = ("pools", "deployments", "instances", "edges")
CATALOG = ("regions", "region-links", "accelerator-types", "models", "adapters")


@pytest.fixture
def viewer_client(
    make_tenant: Callable[..., Tenant],
    make_viewer: Callable[[Tenant], User],
    client_for: Callable[[User | None], APIClient],
) -> APIClient:
    return client_for(make_viewer(make_tenant("acme")))


@pytest.mark.parametrize("resource", STAFF_ONLY)
def test_tenant_viewer_cannot_see_the_fleet(
    viewer_client: APIClient, deployment: Deployment, resource: str
) -> None:
    make_instance(deployment, "i-1")
    assert viewer_client.get(f"{API}/{resource}/").status_code == 403
    assert viewer_client.post(f"{API}/{resource}/", {}, format="json").status_code == 403


def test_tenant_viewer_cannot_use_fleet_actions(
    viewer_client: APIClient, deployment: Deployment
) -> None:
    instance = make_instance(deployment, "i-1", "ready")
    assert viewer_client.get(f"{API}/instances/{instance.pk}/").status_code == 403
    assert viewer_client.post(f"{API}/instances/{instance.pk}/drain/").status_code == 403
    assert viewer_client.post(f"{API}/pools/{deployment.pool_id}/cordon/").status_code == 403
    assert viewer_client.post(f"{API}/regions/us-east/evacuate/").status_code == 403
    instance.refresh_from_db()
    assert instance.state == "ready"


@pytest.mark.parametrize("resource", CATALOG)
def test_tenant_viewer_reads_the_catalog_but_cannot_write_it(
    viewer_client: APIClient, fleet: dict[str, Any], resource: str
) -> None:
    assert viewer_client.get(f"{API}/{resource}/").status_code == 200
    assert viewer_client.post(f"{API}/{resource}/", {}, format="json").status_code == 403


def test_tenant_viewer_reads_region_and_model_details(
    viewer_client: APIClient, fleet: dict[str, Any]
) -> None:
    assert viewer_client.get(f"{API}/regions/us-east/").json()["code"] == "us-east"
    assert viewer_client.get(f"{API}/models/{fleet['m8'].pk}/").status_code == 200
    assert viewer_client.patch(f"{API}/regions/us-east/", {"name": "x"}).status_code == 403
    assert viewer_client.delete(f"{API}/models/{fleet['m8'].pk}/").status_code == 403


def test_anonymous_is_refused(client_for: Callable[[User | None], APIClient]) -> None:
    assert client_for(None).get(f"{API}/regions/").status_code in (401, 403)


# --- query counts --------------------------------------------------------------------------


@pytest.fixture
def big_fleet(fleet: dict[str, Any]) -> None:
    """Enough rows that an N+1 would show: 3 regions, 6 pools, deployments with adapters."""
    adapters = [
        LoraAdapter.objects.create(base_model=fleet["m8"], name=f"a-{i}", rank=8, source="s3://x")
        for i in range(3)
    ]
    for code in ("eu-west", "ap-south"):
        region = make_region(code, "EU")
        for name in ("p1", "p2"):
            pool = make_pool(region, name)
            dep = make_deployment(
                fleet["m8"], pool, desired_replicas=2, max_replicas=2, adapters=adapters
            )
            make_instance(dep, f"i-{code}-{name}-1", "ready")
            make_instance(dep, f"i-{code}-{name}-2", "loading")
        services.region_link_set(actor=None, source=fleet["region"], target=region, rtt_ms=9)
        services.edge_register(
            actor=None, region=region, name=f"edge-{code}", url=f"https://edge.{code}.example"
        )


@pytest.mark.parametrize(
    "resource",
    [
        "regions",
        "region-links",
        "accelerator-types",
        "pools",
        "models",
        "adapters",
        "deployments",
        "instances",
        "edges",
    ],
)
def test_list_queries_are_bounded(
    admin_client: APIClient,
    big_fleet: None,
    resource: str,
    django_assert_max_num_queries: Any,
) -> None:
    admin_client.get(f"{API}/me/")  # a token's first use stamps last_used_at (once a minute)
    # token+user 1, membership 1, count 1, page 1, adapters prefetch 1 (deployments only).
    with django_assert_max_num_queries(5):
        response = admin_client.get(f"{API}/{resource}/")
    assert response.status_code == 200
    assert response.json()["count"] >= 2


# --- schema --------------------------------------------------------------------------------


def test_schema_documents_errors_and_strict_bodies(admin_client: APIClient) -> None:
    schema = admin_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    doc = schema.json()
    create = doc["paths"]["/api/v1/deployments/"]["post"]
    assert {"201", "400", "401", "403", "409", "413"} <= set(create["responses"])
    transition = doc["paths"]["/api/v1/instances/{id}/transition/"]["post"]
    assert {"200", "400", "404", "409"} <= set(transition["responses"])
    body = doc["components"]["schemas"]["DeploymentCreateInputRequest"]
    assert body["additionalProperties"] is False
    assert body["properties"]["engine_args"]["type"] == "object"
    assert "description" not in doc["components"]["schemas"]["RegionCreateInputRequest"]
    price = doc["components"]["schemas"]["PoolCreateInputRequest"]["properties"][
        "price_per_gpu_hour"
    ]
    pattern = re.compile(price["pattern"])
    assert [bool(pattern.match(v)) for v in ("2.5", "2", ".25", "123456.1234")] == [True] * 4
    assert [bool(pattern.match(v)) for v in ("", "-1", ".", "1.23456", "1234567")] == [False] * 5
