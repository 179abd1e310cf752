"""The inventory REST API for GPU pools: CRUD with audit, strict validation that writes
nothing, duplicate names, the cordon and uncordon actions and their effect on new
placements, updates refused when a deployment would no longer fit, filters, ordering and
pagination, and deletes refused while a pool is deployed to."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from federation.inventory.models import GPUPool
from tests.integration.inventory_api_support import (  # noqa: F401  (fixture)
    API,
    actions_for,
    counts,
    fleet_fixture,
)
from tests.integration.inventory_factories import make_deployment, make_pool, make_region

pytestmark = pytest.mark.django_db


def pool_body(**kw: Any) -> dict[str, Any]:
    return {
        "region": "us-east",
        "name": "h100",
        "accelerator": "H100-80G",
        "gpus_per_node": 8,
        "node_count": 2,
        "interconnect": "nvlink",
        "price_per_gpu_hour": "2.5000",
        "capacity_type": "on_demand",
        **kw,
    }


def test_pool_crud(admin_client: APIClient) -> None:
    make_region("us-east")
    created = admin_client.post(f"{API}/pools/", pool_body(), format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert (body["region"], body["accelerator"]) == ("us-east", "H100-80G")
    assert (body["total_gpus"], body["used_gpus"], body["free_gpus"]) == (16, 0, 16)
    assert body["status"] == "active"
    pk = body["id"]

    patched = admin_client.patch(f"{API}/pools/{pk}/", {"node_count": 4}, format="json")
    assert patched.status_code == 200, patched.json()
    assert patched.json()["total_gpus"] == 32

    put = admin_client.put(
        f"{API}/pools/{pk}/",
        {k: v for k, v in pool_body(name="h100-b", capacity_type="spot").items() if k != "region"},
        format="json",
    )
    assert put.status_code == 200, put.json()
    assert (put.json()["name"], put.json()["capacity_type"]) == ("h100-b", "spot")

    pool = GPUPool.objects.get(pk=pk)
    assert admin_client.delete(f"{API}/pools/{pk}/").status_code == 204
    assert actions_for(pool) == ["pool.delete", "pool.update", "pool.update", "pool.create"]


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        (pool_body(node_count=-1), "node_count", "greater than or equal to 0"),
        (pool_body(gpus_per_node=0), "gpus_per_node", "greater than or equal to 1"),
        (pool_body(gpus_per_node="eight"), "gpus_per_node", "number is required"),
        (pool_body(gpus_per_node="8"), "gpus_per_node", "number is required"),
        (pool_body(gpus_per_node=True), "gpus_per_node", "number is required"),
        (pool_body(gpus_per_node=7.5), "gpus_per_node", "valid integer"),
        (pool_body(rdma="yes"), "rdma", "valid boolean"),
        (pool_body(rdma=1), "rdma", "valid boolean"),
        (pool_body(gpus_per_node=2**40), "gpus_per_node", "less than or equal to"),
        (pool_body(name="h100 gpus"), "name", "lowercase letters"),
        (pool_body(name="пул"), "name", "lowercase letters"),
        (pool_body(region="mars-1"), "region", "does not exist"),
        (pool_body(accelerator="TPU-v5"), "accelerator", "does not exist"),
        (pool_body(gpu_memory_utilization=1.5), "gpu_memory_utilization", "less than or equal"),
        (pool_body(price_per_gpu_hour="-1"), "price_per_gpu_hour", "greater than or equal"),
        (pool_body(status="cordoned"), "status", "Unknown field"),
        (
            pool_body(accelerator="L4-24G", interconnect="nvlink"),
            "interconnect",
            "L4-24G has no NVLink; use 'pcie'",
        ),
    ],
)
def test_pool_bad_input(
    admin_client: APIClient, body: dict[str, Any], field: str, text: str
) -> None:
    make_region("us-east")
    before = counts()
    response = admin_client.post(f"{API}/pools/", body, format="json")
    assert response.status_code == 400, response.json()
    assert text in " ".join(response.json()[field])
    assert counts() == before


def test_duplicate_pool_name_in_region(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    response = admin_client.post(f"{API}/pools/", pool_body(), format="json")
    assert response.status_code == 409  # a conflict with an existing pool, not bad syntax
    assert "unique" in str(response.json())


def test_cordon_blocks_new_placements(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    pool = fleet["h100"]
    response = admin_client.post(f"{API}/pools/{pool.pk}/cordon/")
    assert response.status_code == 200
    assert response.json()["status"] == "cordoned"
    assert admin_client.post(f"{API}/pools/{pool.pk}/cordon/").status_code == 200  # idempotent
    assert actions_for(pool) == ["pool.cordon", "pool.create"]

    before = counts()
    response = admin_client.post(
        f"{API}/deployments/",
        {"model": fleet["m8"].pk, "pool": pool.pk, "tensor_parallel_size": 1},
        format="json",
    )
    assert response.status_code == 409
    assert "uncordon it first" in response.json()["detail"]
    assert counts() == before

    response = admin_client.post(f"{API}/pools/{pool.pk}/uncordon/")
    assert response.json()["status"] == "active"
    response = admin_client.post(
        f"{API}/deployments/",
        {"model": fleet["m8"].pk, "pool": pool.pk, "tensor_parallel_size": 1},
        format="json",
    )
    assert response.status_code == 201


def test_pool_update_that_would_break_a_deployment_is_refused(
    admin_client: APIClient, fleet: dict[str, Any]
) -> None:
    pool = fleet["h100"]
    make_deployment(fleet["m70"], pool, tp=4, desired_replicas=3, max_replicas=4)
    before = counts()
    response = admin_client.patch(
        f"{API}/pools/{pool.pk}/",
        {"node_count": 1, "gpu_memory_utilization": 0.5},
        format="json",
    )
    assert response.status_code == 400
    errors = " | ".join(response.json()["non_field_errors"])
    assert "would no longer fit" in errors
    assert "offers 40.0 GiB" in errors
    assert "pool us-east/h100 has 8 GPUs" in errors
    pool.refresh_from_db()
    assert (pool.node_count, pool.gpu_memory_utilization) == (2, 0.9)
    assert counts() == before


def test_pool_filters_and_pagination(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    eu = make_region("eu-west", "EU")
    make_pool(eu, "a100", accelerator="A100-80G", capacity_type="spot", interconnect="pcie")
    make_deployment(fleet["m70"], fleet["h100"], tp=4, desired_replicas=3, max_replicas=3)

    def names(**params: Any) -> list[str]:
        response = admin_client.get(f"{API}/pools/", params)
        assert response.status_code == 200, response.json()
        return [f"{p['region']}/{p['name']}" for p in response.json()["results"]]

    assert names(region="us-east") == ["us-east/h100", "us-east/l4"]
    assert names(accelerator="A100-80G") == ["eu-west/a100"]
    assert names(capacity_type="spot") == ["eu-west/a100"]
    assert names(min_free_gpus=5) == ["eu-west/a100"]
    assert names(ordering="-price_per_gpu_hour,name")[0] in {"eu-west/a100", "us-east/h100"}
    assert names(ordering="free_gpus,name") == ["us-east/h100", "us-east/l4", "eu-west/a100"]
    page = admin_client.get(f"{API}/pools/", {"limit": 2, "offset": 1}).json()
    assert page["count"] == 3
    assert [p["name"] for p in page["results"]] == ["h100", "l4"]
    h100 = admin_client.get(f"{API}/pools/{fleet['h100'].pk}/").json()
    assert (h100["used_gpus"], h100["free_gpus"]) == (12, 4)
    assert admin_client.get(f"{API}/pools/", {"status": "bogus"}).status_code == 400


def test_pool_delete_refused_while_deployed(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    make_deployment(fleet["m8"], fleet["h100"])
    response = admin_client.delete(f"{API}/pools/{fleet['h100'].pk}/")
    assert response.status_code == 409
    assert response.json()["code"] == "protected"
    assert GPUPool.objects.filter(pk=fleet["h100"].pk).exists()
