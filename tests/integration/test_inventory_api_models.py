"""The inventory REST API for language models, LoRA adapters and deployments: CRUD,
validation, model and deployment updates re-checked against what already runs, adapters
bound to their base model, deployments that do not fit refused with the constraint named,
duplicates as a 409, filters, and deletes refused while something still depends on them."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.inventory.models import Deployment, Instance, LanguageModel
from tests.integration.inventory_api_support import (  # noqa: F401  (fixture)
    API,
    actions_for,
    counts,
    fleet_fixture,
)
from tests.integration.inventory_factories import (
    LLAMA_8B,
    LLAMA_70B,
    make_deployment,
    make_instance,
    make_pool,
    make_region,
)

pytestmark = pytest.mark.django_db


def jsonable(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if k == "parameter_count_b" else v for k, v in spec.items()}


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
