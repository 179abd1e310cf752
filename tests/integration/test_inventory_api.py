"""The inventory REST API: CRUD, validation, actions, filters, permissions and query counts."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.inventory import services
from federation.inventory.models import (
    Deployment,
    Edge,
    GPUPool,
    Instance,
    LanguageModel,
    LoraAdapter,
    Region,
    RegionLink,
)
from federation.tenancy.models import Tenant
from tests.integration.inventory_factories import (
    LLAMA_8B,
    LLAMA_70B,
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)

pytestmark = pytest.mark.django_db

API = "/api/v1"
MODELS = (Region, RegionLink, GPUPool, LanguageModel, LoraAdapter, Deployment, Instance, Edge)


def counts() -> dict[str, int]:
    """Row counts of every inventory table and the audit trail: 'nothing half-written'."""
    rows = {m.__name__: m.objects.count() for m in MODELS}
    rows["audit"] = AuditEvent.objects.count()
    return rows


def actions_for(obj: Any) -> list[str]:
    return list(
        AuditEvent.objects.filter(
            object_type=obj._meta.label_lower, object_id=str(obj.pk)
        ).values_list("action", flat=True)
    )


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


def jsonable(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if k == "parameter_count_b" else v for k, v in spec.items()}


@pytest.fixture
def fleet(db: None) -> dict[str, Any]:
    """One region with an 16-GPU H100 NVLink pool and a 4-GPU L4 PCIe pool, two models."""
    region = make_region("us-east")
    return {
        "region": region,
        "h100": make_pool(region, "h100"),
        "l4": make_pool(
            region, "l4", accelerator="L4-24G", gpus_per_node=4, node_count=1, interconnect="pcie"
        ),
        "m8": make_model(LLAMA_8B),
        "m70": make_model(LLAMA_70B),
    }


# --- regions -------------------------------------------------------------------------------


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


# --- pools ---------------------------------------------------------------------------------


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


# --- models and adapters -------------------------------------------------------------------


def test_model_crud(admin_client: APIClient) -> None:
    created = admin_client.post(f"{API}/models/", jsonable(LLAMA_8B), format="json")
    assert created.status_code == 201, created.json()
    pk = created.json()["id"]
    assert created.json()["name"] == LLAMA_8B["name"]
    patched = admin_client.patch(f"{API}/models/{pk}/", {"family": "Llama 3.1 «instruct»"})
    assert patched.status_code == 200
    assert patched.json()["family"] == "Llama 3.1 «instruct»"
    assert admin_client.delete(f"{API}/models/{pk}/").status_code == 204
    assert not LanguageModel.objects.exists()


@pytest.mark.parametrize(
    ("change", "field", "text"),
    [
        ({"name": "лама-8b"}, "name", "Use letters, digits"),
        ({"num_kv_heads": 64}, "num_kv_heads", "num_kv_heads 64 exceeds num_attention_heads 32"),
        ({"num_kv_heads": 5}, "num_kv_heads", "multiple of num_kv_heads 5"),
        ({"max_context_tokens": 100}, "max_context_tokens", "greater than or equal to 256"),
        ({"parameter_count_b": "0"}, "parameter_count_b", "greater than or equal to 0.01"),
        ({"dtype": "fp64"}, "dtype", "not a valid choice"),
        ({"num_layers": -3}, "num_layers", "greater than or equal to"),
    ],
)
def test_model_bad_input(
    admin_client: APIClient, change: dict[str, Any], field: str, text: str
) -> None:
    response = admin_client.post(f"{API}/models/", {**jsonable(LLAMA_8B), **change}, format="json")
    assert response.status_code == 400
    assert text in " ".join(response.json()[field])
    assert not LanguageModel.objects.exists()


def test_model_update_that_would_break_a_deployment_is_refused(
    admin_client: APIClient, fleet: dict[str, Any]
) -> None:
    make_deployment(fleet["m8"], fleet["l4"], tp=2)
    before = counts()
    response = admin_client.patch(f"{API}/models/{fleet['m8'].pk}/", {"weight_size_gib": 60})
    assert response.status_code == 400
    [message] = response.json()["non_field_errors"]
    assert message.startswith(
        f"deployment {LLAMA_8B['name']} on us-east/l4 (mixed) would no longer fit: "
        "needs 32.0 GiB per GPU (weights 30.0 + "
    )
    assert "L4-24G at 0.90 offers 21.6 GiB" in message
    fleet["m8"].refresh_from_db()
    assert fleet["m8"].weight_size_gib == 15.0
    assert counts() == before
    # A change that keeps every deployment fitting goes through.
    ok = admin_client.patch(f"{API}/models/{fleet['m8'].pk}/", {"weight_size_gib": 16})
    assert ok.status_code == 200, ok.json()
    fleet["m8"].refresh_from_db()
    assert fleet["m8"].weight_size_gib == 16


def test_adapters(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    body = {"base_model": fleet["m8"].pk, "name": "acme/sql-lora", "rank": 16, "source": "s3://a"}
    created = admin_client.post(f"{API}/adapters/", body, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["base_model_name"] == LLAMA_8B["name"]
    patched = admin_client.patch(f"{API}/adapters/{created.json()['id']}/", {"rank": 32})
    assert patched.status_code == 200
    assert patched.json()["rank"] == 32
    assert (
        admin_client.patch(f"{API}/adapters/{created.json()['id']}/", {"rank": 0}).status_code
        == 400
    )
    duplicate = admin_client.post(f"{API}/adapters/", body, format="json")
    assert duplicate.status_code == 409
    assert "already exists" in duplicate.json()["errors"]["name"][0]
    foreign = admin_client.post(
        f"{API}/adapters/",
        {**body, "name": "acme/70b-lora", "base_model": fleet["m70"].pk},
        format="json",
    )
    # An adapter of another base model is refused on the deployment, naming both models.
    response = admin_client.post(
        f"{API}/deployments/",
        {
            "model": fleet["m8"].pk,
            "pool": fleet["l4"].pk,
            "tensor_parallel_size": 1,
            "adapters": [created.json()["id"], foreign.json()["id"]],
        },
        format="json",
    )
    assert response.status_code == 400
    assert response.json()["adapters"] == [
        f"adapter 'acme/70b-lora' belongs to base model '{LLAMA_70B['name']}', "
        f"not '{LLAMA_8B['name']}'"
    ]
    ok = admin_client.post(
        f"{API}/deployments/",
        {
            "model": fleet["m8"].pk,
            "pool": fleet["l4"].pk,
            "tensor_parallel_size": 1,
            "adapters": [created.json()["id"]],
        },
        format="json",
    )
    assert ok.status_code == 201
    assert ok.json()["adapters"] == [created.json()["id"]]
    refused = admin_client.delete(f"{API}/adapters/{created.json()['id']}/")
    assert refused.status_code == 409
    assert "serve it" in refused.json()["detail"]
    assert admin_client.delete(f"{API}/adapters/{foreign.json()['id']}/").status_code == 204


# --- deployments ---------------------------------------------------------------------------


def test_deployment_that_does_not_fit_is_a_400_naming_the_constraint(
    admin_client: APIClient, fleet: dict[str, Any]
) -> None:
    before = counts()
    response = admin_client.post(
        f"{API}/deployments/",
        {"model": fleet["m70"].pk, "pool": fleet["h100"].pk, "tensor_parallel_size": 2},
        format="json",
    )
    assert response.status_code == 400
    [message] = response.json()["tensor_parallel_size"]
    assert message.startswith("needs 87.0 GiB per GPU (weights 65.5 + KV cache for one ")
    assert "H100-80G at 0.90 offers 72.0 GiB" in message
    assert counts() == before

    response = admin_client.post(
        f"{API}/deployments/",
        {"model": fleet["m70"].pk, "pool": fleet["l4"].pk, "tensor_parallel_size": 4},
        format="json",
    )
    assert response.status_code == 400
    messages = " | ".join(response.json()["tensor_parallel_size"])
    assert "tensor_parallel_size 4 > 2 needs NVLink" in messages
    assert "L4-24G at 0.90 offers 21.6 GiB" in messages
    assert counts() == before


def test_deployment_that_fits_is_created(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    response = admin_client.post(
        f"{API}/deployments/",
        {
            "model": fleet["m70"].pk,
            "pool": fleet["h100"].pk,
            "tensor_parallel_size": 4,
            "min_replicas": 1,
            "desired_replicas": 2,
            "max_replicas": 4,
            "role": "prefill",
            "engine_args": {"max-num-seqs": 128, "enable-chunked-prefill": True},
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["region"], body["pool_name"], body["gpus"]) == ("us-east", "h100", 8)
    assert body["engine_args"] == {"max-num-seqs": 128, "enable-chunked-prefill": True}
    dep = Deployment.objects.get(pk=body["id"])
    assert actions_for(dep) == ["deployment.create"]
    assert admin_client.get(f"{API}/pools/{fleet['h100'].pk}/").json()["free_gpus"] == 8


@pytest.mark.parametrize(
    ("change", "field", "text"),
    [
        ({"desired_replicas": 5, "max_replicas": 5}, "desired_replicas", "needs 20 GPUs"),
        ({"min_replicas": 3, "desired_replicas": 2}, "min_replicas", "exceeds desired_replicas"),
        ({"min_replicas": -1}, "min_replicas", "greater than or equal to 0"),
        ({"engine_args": {"port": 9}}, "engine_args", "'port' is set by the platform"),
        ({"engine_args": ["--port", "9"]}, "engine_args", "Expected a dictionary"),
        ({"engine_args": None}, "engine_args", "may not be null"),
        ({"engine_args": {"served-model-name": "x"}}, "engine_args", "set by the platform"),
        ({"engine_args": {"chat-template": "a\u0000b"}}, "engine_args", "no NUL"),
        ({"tensor_parallel_size": 3}, "tensor_parallel_size", "not divisible"),
        ({"tensor_parallel_size": "four"}, "tensor_parallel_size", "number is required"),
        ({"role": "both"}, "role", "not a valid choice"),
        ({"adapters": [999999]}, "adapters", "does not exist"),
        ({"pool": 999999}, "pool", "does not exist"),
        ({"replicas": 2}, "replicas", "Unknown field"),
    ],
)
def test_deployment_bad_input(
    admin_client: APIClient, fleet: dict[str, Any], change: dict[str, Any], field: str, text: str
) -> None:
    body = {
        "model": fleet["m70"].pk,
        "pool": fleet["h100"].pk,
        "tensor_parallel_size": 4,
        "max_replicas": 2,
        **change,
    }
    before = counts()
    response = admin_client.post(f"{API}/deployments/", body, format="json")
    assert response.status_code == 400, response.json()
    assert text in " ".join(map(str, response.json()[field]))
    assert counts() == before


def test_duplicate_deployment_is_a_409_duplicate(
    admin_client: APIClient, fleet: dict[str, Any]
) -> None:
    make_deployment(fleet["m8"], fleet["h100"])
    response = admin_client.post(
        f"{API}/deployments/",
        {"model": fleet["m8"].pk, "pool": fleet["h100"].pk, "tensor_parallel_size": 1},
        format="json",
    )
    assert response.status_code == 409
    assert response.json()["code"] == "duplicate"
    assert "already exists" in str(response.json()["errors"]["non_field_errors"])


def test_deployment_update_is_rechecked(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    dep = make_deployment(fleet["m70"], fleet["h100"], tp=4, desired_replicas=2, max_replicas=4)
    make_deployment(fleet["m8"], fleet["h100"], tp=1, desired_replicas=4, max_replicas=4)
    # 8 + 4 of 16 GPUs are used; a 4th replica of TP 4 would need 16 with 12 free.
    response = admin_client.patch(
        f"{API}/deployments/{dep.pk}/", {"desired_replicas": 4}, format="json"
    )
    assert response.status_code == 400
    assert response.json()["desired_replicas"] == [
        "needs 16 GPUs (4 replicas x tensor_parallel_size 4) but pool us-east/h100 has 16 GPUs, "
        "4 used by other deployments, 12 free"
    ]
    ok = admin_client.patch(f"{API}/deployments/{dep.pk}/", {"desired_replicas": 3})
    assert ok.status_code == 200
    assert ok.json()["gpus"] == 12
    dep.refresh_from_db()
    assert dep.desired_replicas == 3
    event = AuditEvent.objects.filter(action="deployment.update").get()
    assert event.changes == {"desired_replicas": [2, 3]}
    # Model, pool and role are fixed after creation.
    moved = admin_client.patch(f"{API}/deployments/{dep.pk}/", {"pool": fleet["l4"].pk})
    assert moved.status_code == 400
    assert moved.json() == {"pool": ["Unknown field."]}


def test_deployment_filters_and_delete(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    eu = make_region("eu-west", "EU")
    eu_pool = make_pool(eu, "h100")
    a = make_deployment(fleet["m8"], fleet["h100"], role="prefill")
    make_deployment(fleet["m8"], fleet["h100"], role="decode")
    make_deployment(fleet["m70"], eu_pool, tp=4)

    def ids(**params: Any) -> list[int]:
        response = admin_client.get(f"{API}/deployments/", params)
        assert response.status_code == 200
        return sorted(d["id"] for d in response.json()["results"])

    assert len(ids(region="us-east")) == 2
    assert ids(role="prefill") == [a.pk]
    assert len(ids(model=fleet["m70"].pk)) == 1
    assert len(ids(pool=eu_pool.pk)) == 1
    make_instance(a, "i-a", "stopped")
    refused = admin_client.delete(f"{API}/deployments/{a.pk}/")
    assert refused.status_code == 409
    assert "instances" in refused.json()["detail"]
    Instance.objects.all().delete()
    assert admin_client.delete(f"{API}/deployments/{a.pk}/").status_code == 204


# --- instances -----------------------------------------------------------------------------


@pytest.fixture
def deployment(fleet: dict[str, Any]) -> Deployment:
    return make_deployment(fleet["m8"], fleet["h100"], desired_replicas=2, max_replicas=2)


def test_instance_lifecycle_through_the_api(
    admin_client: APIClient, deployment: Deployment
) -> None:
    created = admin_client.post(
        f"{API}/instances/",
        {"deployment": deployment.pk, "name": "i-1", "endpoint_url": "http://10.0.0.1:8000"},
        format="json",
    )
    assert created.status_code == 201, created.json()
    assert created.json()["state"] == "pending"
    url = f"{API}/instances/{created.json()['id']}"

    illegal = admin_client.post(f"{url}/transition/", {"state": "ready"}, format="json")
    assert illegal.status_code == 409
    assert illegal.json() == {
        "detail": "An instance in state 'pending' cannot move to 'ready'; "
        "allowed from 'pending': loading, stopped, failed.",
        "code": "illegal_transition",
    }
    assert admin_client.post(f"{url}/drain/").status_code == 409
    for state in ("loading", "warming", "ready"):
        response = admin_client.post(f"{url}/transition/", {"state": state}, format="json")
        assert response.status_code == 200, response.json()
        assert response.json()["state"] == state

    drained = admin_client.post(f"{url}/drain/")
    assert (drained.json()["state"], drained.json()["drain_reason"]) == ("draining", "operator")
    assert admin_client.post(f"{url}/drain/").status_code == 200  # idempotent
    undrained = admin_client.post(f"{url}/undrain/")
    assert (undrained.json()["state"], undrained.json()["drain_reason"]) == ("ready", "")

    assert admin_client.delete(f"{url}/").status_code == 409  # still serving
    assert admin_client.post(f"{url}/transition/", {"state": "stopped"}).status_code == 200
    instance = Instance.objects.get(name="i-1")
    assert admin_client.delete(f"{url}/").status_code == 204
    assert actions_for(instance) == [
        "instance.delete",
        *["instance.transition"] * 6,
        "instance.create",
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"state": "serving"}, "state"),
        ({"state": ""}, "state"),
        ({}, "state"),
        ({"state": "loading", "force": True}, "force"),
    ],
)
def test_transition_bad_input(
    admin_client: APIClient, deployment: Deployment, body: dict[str, Any], field: str
) -> None:
    instance = make_instance(deployment, "i-1")
    response = admin_client.post(f"{API}/instances/{instance.pk}/transition/", body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    instance.refresh_from_db()
    assert instance.state == "pending"


def test_instances_beyond_max_replicas_are_refused(
    admin_client: APIClient, deployment: Deployment
) -> None:
    make_instance(deployment, "i-1")
    stopped = make_instance(deployment, "i-2", "stopped")
    make_instance(deployment, "i-3")
    before = counts()
    response = admin_client.post(
        f"{API}/instances/",
        {"deployment": deployment.pk, "name": "i-4", "endpoint_url": "http://i-4.local:8000"},
        format="json",
    )
    assert response.status_code == 409
    assert "max_replicas is 2" in response.json()["detail"]
    restart = admin_client.post(f"{API}/instances/{stopped.pk}/transition/", {"state": "pending"})
    assert restart.status_code == 409, restart.json()
    assert counts() == before


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        ({"name": "\u0399-1"}, "name", "lowercase letters"),  # Greek capital iota
        ({"endpoint_url": "not a url"}, "endpoint_url", "valid URL"),
        # Not an origin: the edges would refuse the whole routing table naming it.
        ({"endpoint_url": "http://i-1.local:8000/v1"}, "endpoint_url", "valid URL"),
        ({"endpoint_url": "http://user:pw@i-1.local:8000"}, "endpoint_url", "valid URL"),
        ({"endpoint_url": "http://i-1.local:8000?x=1"}, "endpoint_url", "valid URL"),
        ({"endpoint_url": "ftp://i-1.local:8000"}, "endpoint_url", "valid URL"),
        ({"endpoint_url": "http://i-0.local:8000"}, "endpoint_url", "already exists"),
        ({"deployment": "one"}, "deployment", "Incorrect type"),
        ({"state": "ready"}, "state", "Unknown field"),
    ],
)
def test_instance_bad_input(
    admin_client: APIClient, deployment: Deployment, body: dict[str, Any], field: str, text: str
) -> None:
    make_instance(deployment, "i-0")
    before = counts()
    full = {
        "deployment": deployment.pk,
        "name": "i-1",
        "endpoint_url": "http://i-1.local:8000",
        **body,
    }
    response = admin_client.post(f"{API}/instances/", full, format="json")
    expected = 409 if text == "already exists" else 400  # duplicates conflict with state
    assert response.status_code == expected, response.json()
    errors = response.json()["errors"] if expected == 409 else response.json()
    assert text in " ".join(errors[field])
    assert counts() == before


def test_instance_heartbeat_update_and_filters(
    admin_client: APIClient, deployment: Deployment
) -> None:
    ready = make_instance(deployment, "i-ready", "ready")
    make_instance(deployment, "i-loading", "loading")
    response = admin_client.patch(
        f"{API}/instances/{ready.pk}/",
        {"last_heartbeat_at": "2026-11-29T10:00:00Z", "load": {"running": 3, "waiting": 0}},
        format="json",
    )
    assert response.status_code == 200, response.json()
    assert response.json()["load"] == {"running": 3, "waiting": 0}
    bad = admin_client.patch(f"{API}/instances/{ready.pk}/", {"load": [1, 2]}, format="json")
    assert bad.status_code == 400

    def names(**params: Any) -> list[str]:
        return [i["name"] for i in admin_client.get(f"{API}/instances/", params).json()["results"]]

    assert names(state="ready") == ["i-ready"]
    assert names(state=["ready", "loading"]) == ["i-loading", "i-ready"]
    assert names(region="us-east") == ["i-loading", "i-ready"]
    assert names(region="eu-west") == []
    assert names(deployment=deployment.pk, ordering="-name") == ["i-ready", "i-loading"]


# --- edges ---------------------------------------------------------------------------------


def test_edge_crud(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    created = admin_client.post(
        f"{API}/edges/",
        {"region": "us-east", "name": "edge-a", "url": "https://edge-a.us-east.example"},
        format="json",
    )
    assert created.status_code == 201, created.json()
    pk = created.json()["id"]
    patched = admin_client.patch(
        f"{API}/edges/{pk}/",
        {"applied_table_version": 42, "last_heartbeat_at": "2026-11-29T10:00:00Z"},
        format="json",
    )
    assert patched.json()["applied_table_version"] == 42
    negative = admin_client.patch(f"{API}/edges/{pk}/", {"applied_table_version": -1})
    assert negative.status_code == 400
    assert admin_client.get(f"{API}/edges/", {"region": "us-east"}).json()["count"] == 1
    edge = Edge.objects.get(pk=pk)
    assert admin_client.delete(f"{API}/edges/{pk}/").status_code == 204
    assert actions_for(edge) == ["edge.delete", "edge.update", "edge.register"]


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
