"""Inventory services called directly, and hostile input the API must survive."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db.models import ProtectedError
from django.test import Client
from rest_framework.test import APIClient

from federation.core.errors import Conflict
from federation.core.models import AuditEvent
from federation.inventory import services
from federation.inventory.models import (
    AcceleratorType,
    Instance,
    LoraAdapter,
    Region,
    RegionLink,
)
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


@pytest.fixture
def fleet() -> dict[str, Any]:
    region = make_region("us-east")
    pool = make_pool(region, "h100")
    m8, m70 = make_model(LLAMA_8B), make_model(LLAMA_70B)
    return {"region": region, "pool": pool, "m8": m8, "m70": m70}


def test_system_actor_is_recorded(fleet: dict[str, Any]) -> None:
    event = AuditEvent.objects.get(action="pool.create")
    assert (event.actor, event.actor_repr, event.object_repr) == (
        None,
        "system",
        str(fleet["pool"]),
    )


def test_swapping_the_accelerator_rechecks_memory(fleet: dict[str, Any]) -> None:
    make_deployment(fleet["m70"], fleet["pool"], tp=4)
    l40s = AcceleratorType.objects.get(name="L40S-48G")
    with pytest.raises(ValidationError) as caught:
        services.pool_update(
            actor=None,
            pool=fleet["pool"],
            data={"accelerator": l40s, "interconnect": "pcie"},
        )
    messages = " | ".join(caught.value.message_dict["__all__"])
    assert "L40S-48G at 0.90 offers 43.2 GiB" in messages
    assert "tensor_parallel_size 4 > 2 needs NVLink" in messages
    fleet["pool"].refresh_from_db()
    assert fleet["pool"].accelerator.name == "H100-80G"


def test_pool_changes_do_not_blame_problems_a_deployment_already_had(
    fleet: dict[str, Any],
) -> None:
    """A pool change is judged only by the problems it adds."""
    dep = make_deployment(fleet["m8"], fleet["pool"], desired_replicas=2, max_replicas=2)
    # Put the deployment out of bounds behind the services' back (e.g. an old row).
    type(dep).objects.filter(pk=dep.pk).update(engine_args={"port": 1})
    pool = services.pool_update(actor=None, pool=fleet["pool"], data={"price_per_gpu_hour": 3})
    assert pool.price_per_gpu_hour == 3


def test_scaling_up_on_a_cordoned_pool_is_refused_but_down_is_not(fleet: dict[str, Any]) -> None:
    dep = make_deployment(fleet["m8"], fleet["pool"], desired_replicas=2, max_replicas=4)
    services.pool_cordon(actor=None, pool=fleet["pool"])
    with pytest.raises(Conflict, match="uncordon it first"):
        services.deployment_update(actor=None, deployment=dep, data={"desired_replicas": 3})
    dep = services.deployment_update(actor=None, deployment=dep, data={"desired_replicas": 1})
    assert dep.desired_replicas == 1
    with pytest.raises(Conflict):
        make_instance(dep, "i-new")


def test_restarting_an_instance_needs_room_under_max_replicas(fleet: dict[str, Any]) -> None:
    dep = make_deployment(fleet["m8"], fleet["pool"], max_replicas=1)
    old = make_instance(dep, "i-old", "failed")
    new = make_instance(dep, "i-new", "ready")
    with pytest.raises(Conflict, match="max_replicas is 1"):
        services.instance_transition(actor=None, instance=old, state="pending")
    services.instance_transition(actor=None, instance=new, state="stopped")
    old = services.instance_transition(actor=None, instance=old, state="pending")
    assert old.state == "pending"


def test_a_running_engine_is_brought_up_to_ready_step_by_step(fleet: dict[str, Any]) -> None:
    dep = make_deployment(fleet["m8"], fleet["pool"], max_replicas=2)
    inst = services.instance_bring_up(actor=None, instance=make_instance(dep, "i-1"))
    assert inst.state == "ready"
    steps = AuditEvent.objects.filter(object_type="inventory.instance", object_id=str(inst.pk))
    assert steps.filter(action="instance.transition").count() == 3
    second = make_instance(dep, "i-2")
    services.region_evacuate(actor=None, region=fleet["region"])
    with pytest.raises(Conflict, match="evacuated"):  # no ready instance there, whichever way
        services.instance_bring_up(actor=None, instance=second)
    assert Instance.objects.get(name="i-2").state == "pending"  # all or nothing


def test_region_link_set_keeps_the_measured_rtt_unless_given(fleet: dict[str, Any]) -> None:
    eu = make_region("eu-west", "EU")
    link, created = services.region_link_set(
        actor=None, source=fleet["region"], target=eu, rtt_ms=80, measured_rtt_ms=77
    )
    assert created
    link, created = services.region_link_set(
        actor=None, source=fleet["region"], target=eu, rtt_ms=82
    )
    assert not created
    assert (link.rtt_ms, link.measured_rtt_ms) == (82, 77)
    # Unchanged values write no audit event.
    services.region_link_set(actor=None, source=fleet["region"], target=eu, rtt_ms=82)
    assert AuditEvent.objects.filter(object_type="inventory.regionlink").count() == 2
    assert RegionLink.objects.count() == 1


def test_an_attached_adapter_cannot_change_base_model(fleet: dict[str, Any]) -> None:
    adapter = services.adapter_create(
        actor=None, base_model=fleet["m8"], name="sql", rank=8, source="s3://a"
    )
    make_deployment(fleet["m8"], fleet["pool"], adapters=[adapter])
    with pytest.raises(ValidationError) as caught:
        services.adapter_update(actor=None, adapter=adapter, data={"base_model": fleet["m70"]})
    assert "detach it before moving it" in caught.value.message_dict["base_model"][0]
    adapter.refresh_from_db()
    assert adapter.base_model == fleet["m8"]


def test_a_model_with_adapters_cannot_be_deleted(fleet: dict[str, Any]) -> None:
    LoraAdapter.objects.create(base_model=fleet["m8"], name="a", rank=8, source="s3://a")
    with pytest.raises(ProtectedError):
        services.model_delete(actor=None, model=fleet["m8"])
    assert not AuditEvent.objects.filter(action="model.delete").exists()


# --- hostile input through the API ---------------------------------------------------------


def test_deeply_nested_json_is_a_400(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    body = '{"name": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = admin_client.patch(
        f"{API}/regions/us-east/", data=body, content_type="application/json"
    )
    assert response.status_code == 400
    assert "nested too deeply" in response.json()["detail"]


def test_nul_characters_never_reach_postgres(
    admin_client: APIClient, fleet: dict[str, Any]
) -> None:
    assert admin_client.get(f"{API}/regions/a%00b/").status_code == 404
    assert admin_client.get(f"{API}/pools/", {"region": "a\x00b"}).status_code == 400
    response = admin_client.post(
        f"{API}/edges/", {"region": "us\x00", "name": "e", "url": "https://e.example"}
    )
    assert response.status_code == 400
    assert response.json()["region"] == ["Null characters are not allowed."]


@pytest.mark.parametrize(
    ("load", "text"),
    [
        ({"a": "x\x00"}, "NUL"),
        ({"k\x00": 1}, "NUL"),
        ({"a": [[[[[[[[[1]]]]]]]]]}, "deeper than 8"),
    ],
)
def test_load_snapshots_are_bounded(
    admin_client: APIClient, fleet: dict[str, Any], load: dict[str, Any], text: str
) -> None:
    instance = make_instance(make_deployment(fleet["m8"], fleet["pool"]), "i-1")
    response = admin_client.patch(f"{API}/instances/{instance.pk}/", {"load": load})
    assert response.status_code == 400
    assert text in response.json()["load"][0]
    assert Instance.objects.get(pk=instance.pk).load == {}


def test_malformed_ids_are_json_404s(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    for path in ("pools/0.5/", "pools/abc/cordon/", "regions/%C2%84/", "instances/-1/drain/"):
        response = admin_client.generic(
            "POST" if path.endswith(("cordon/", "drain/")) else "GET", f"{API}/{path}"
        )
        assert response.status_code == 404, path
        assert response["Content-Type"] == "application/json"


# --- admin ---------------------------------------------------------------------------------


def test_admin_lists_the_fleet_read_only(fleet: dict[str, Any]) -> None:
    make_instance(make_deployment(fleet["m8"], fleet["pool"]), "i-1", "ready")
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw-root-1"))
    for name in (
        "region",
        "regionlink",
        "acceleratortype",
        "gpupool",
        "languagemodel",
        "loraadapter",
        "deployment",
        "instance",
        "edge",
    ):
        assert client.get(f"/admin/inventory/{name}/").status_code == 200, name
        assert client.get(f"/admin/inventory/{name}/add/").status_code == 403, name
    response = client.get("/admin/inventory/instance/", {"q": "i-1", "state__exact": "ready"})
    assert b"i-1" in response.content


def test_renaming_a_model_keeps_its_adapters_valid(fleet: dict[str, Any]) -> None:
    adapter = services.adapter_create(
        actor=None, base_model=fleet["m8"], name="sql", rank=8, source="s3://a"
    )
    make_deployment(fleet["m8"], fleet["pool"], adapters=[adapter])
    model = services.model_update(actor=None, model=fleet["m8"], data={"name": "llama-8b-v2"})
    assert model.name == "llama-8b-v2"
    event = AuditEvent.objects.get(action="model.update")
    assert event.changes == {"name": [LLAMA_8B["name"], "llama-8b-v2"]}


def test_a_lost_race_for_a_unique_value_is_the_duplicate_full_clean_reports(
    fleet: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """full_clean passed (the winner had not committed yet), then the insert hit the unique
    index: the same duplicate (409 ``duplicate`` through the API), not a 500."""
    monkeypatch.setattr(Region, "full_clean", lambda self, **kwargs: None)
    with pytest.raises(ValidationError) as err:
        make_region("us-east")
    assert [e.code for e in err.value.error_dict["code"]] == ["unique"]
    assert Region.objects.filter(code="us-east").count() == 1


def test_an_integrity_failure_that_is_no_duplicate_is_a_concurrent_change(
    fleet: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database refused what no check can explain: 409 ``concurrent_change``, not a 500."""
    monkeypatch.setattr(Region, "validate_constraints", lambda self, exclude=None: None)
    monkeypatch.setattr(Region, "validate_unique", lambda self, exclude=None: None)
    with pytest.raises(Conflict, match="concurrent change") as err:
        make_region("us-east")
    assert err.value.code == "concurrent_change"
    assert Region.objects.filter(code="us-east").count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["http://vllm-0:8000", "http://vllm-0.vllm.svc.cluster.local:8000"])
def test_edges_and_instances_may_use_in_cluster_service_names(url) -> None:
    region = Region.objects.create(
        code="r1", name="R1", provider="cloud", latitude=0, longitude=0, jurisdiction="EU"
    )
    edge = services.edge_register(actor=None, region=region, name="edge-1", url=url)
    assert edge.url == url


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["ftp://vllm-0:21", "http://", "vllm-0:8000", "http://a b"])
def test_non_http_or_malformed_urls_are_refused(url) -> None:
    region = Region.objects.create(
        code="r1", name="R1", provider="cloud", latitude=0, longitude=0, jurisdiction="EU"
    )
    with pytest.raises(ValidationError) as err:
        services.edge_register(actor=None, region=region, name="edge-1", url=url)
    assert "url" in err.value.message_dict
