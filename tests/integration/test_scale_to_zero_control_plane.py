"""Scale to zero in the control plane, on the real PostgreSQL and Redis: who may opt in, the
heartbeat's ``cold`` report (strict, stored per edge, queueing the autoscale pass at once and
at most once per spacing), which deployment a held request wakes, and the cold start the
tables announce (measured from the deployment's last instance that became ready)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.core.exceptions import ValidationError
from django.utils import timezone
from rest_framework.test import APIClient

from federation.fleet import selectors as fleet
from federation.inventory import lifecycle
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Edge, InstanceInterval
from federation.routing import services as routing
from federation.routing.selectors import cold_rows, loadable_adapters
from federation.telemetry import heartbeats, wake
from tests.integration.control_plane_support import own_redis
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)

REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)


@pytest.fixture(autouse=True)
def test_redis(settings: Any) -> Iterator[redis.Redis]:
    with own_redis(settings, REDIS_URL) as client:
        yield client


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Autoscale passes the control plane queued, instead of sending them to a broker (other
    tasks, the recompiles that registering an edge queues, are dropped)."""
    names: list[str] = []

    def send_task(name: str, **kw: Any) -> None:
        if name == wake.AUTOSCALE_TASK:
            names.append(name)

    monkeypatch.setattr(wake.current_app, "send_task", send_task)
    return names


def zero_deployment(region_code: str = "eu-west", pool: str = "h100", **kw: Any) -> Deployment:
    region = make_region(region_code, "EU") if isinstance(region_code, str) else region_code
    fields: dict[str, Any] = {
        "min_replicas": 0,
        "desired_replicas": 0,
        "max_replicas": 2,
        "autoscale": True,
        "scale_to_zero_after_s": 300,
    }
    fields.update(kw)
    return make_deployment(make_model(), make_pool(region, pool, provisioner="local"), **fields)


def edge_of(region: Any) -> tuple[Edge, APIClient]:
    edge = inventory.edge_register(
        actor=None, region=region, name=f"edge-{region.code}", url="http://edge.local:8080"
    )
    client = APIClient()
    client.credentials(
        HTTP_AUTHORIZATION=f"Bearer {routing.edge_credential_rotate(actor=None, edge=edge)}"
    )
    return edge, client


@pytest.mark.django_db
def test_only_autoscaled_mixed_deployments_with_a_minimum_of_zero_may_opt_in() -> None:
    region = make_region("eu-west", "EU")
    pool = make_pool(region, provisioner="local")
    model = make_model()
    cases = [
        ({"autoscale": False, "min_replicas": 0, "desired_replicas": 0}, "needs autoscale"),
        ({"autoscale": True, "min_replicas": 1, "desired_replicas": 1}, "needs min_replicas 0"),
        (
            {"autoscale": True, "min_replicas": 0, "desired_replicas": 0, "role": "prefill"},
            "only mixed",
        ),
    ]
    for fields, message in cases:
        with pytest.raises(ValidationError, match=message):
            make_deployment(model, pool, max_replicas=2, scale_to_zero_after_s=60, **fields)
    with pytest.raises(ValidationError, match="scale_to_zero_after_s"):
        make_deployment(
            model,
            pool,
            max_replicas=2,
            min_replicas=0,
            desired_replicas=0,
            autoscale=True,
            scale_to_zero_after_s=0,
        )
    dep = make_deployment(
        model,
        pool,
        max_replicas=2,
        min_replicas=0,
        desired_replicas=0,
        autoscale=True,
        scale_to_zero_after_s=60,
    )
    with pytest.raises(ValidationError, match="needs min_replicas 0"):
        inventory.deployment_update(
            actor=None, deployment=dep, data={"min_replicas": 1, "desired_replicas": 1}
        )


@pytest.mark.django_db
def test_the_deployment_api_reads_and_writes_the_opt_in(admin_client: APIClient) -> None:
    dep = zero_deployment()
    r = admin_client.get(f"/api/v1/deployments/{dep.pk}/")
    assert r.status_code == 200 and r.json()["scale_to_zero_after_s"] == 300
    r = admin_client.patch(
        f"/api/v1/deployments/{dep.pk}/", {"scale_to_zero_after_s": None}, format="json"
    )
    assert r.status_code == 200, r.content
    assert Deployment.objects.get(pk=dep.pk).scale_to_zero_after_s is None
    r = admin_client.patch(
        f"/api/v1/deployments/{dep.pk}/", {"scale_to_zero_after_s": "600"}, format="json"
    )
    assert r.status_code == 400  # strict: a string is not a number


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_with_held_requests_queues_the_autoscale_pass_at_once_and_spaced(
    sent: list[str],
) -> None:
    dep = zero_deployment()
    edge, client = edge_of(dep.pool.region)
    url = f"/api/v1/edges/{edge.name}/heartbeat"
    name = dep.model.name
    quiet = {"cold": [{"model": name, "held": 0, "arrived": 0}]}
    assert client.post(url, quiet, format="json").status_code == 200
    assert sent == []
    assert Edge.objects.get(pk=edge.pk).cold_demand[name]["held"] == 0
    body = {"cold": [{"model": name, "held": 2, "arrived": 3}]}
    assert client.post(url, body, format="json").status_code == 200
    assert sent == [wake.AUTOSCALE_TASK]
    assert client.post(url, body, format="json").status_code == 200
    assert sent == [wake.AUTOSCALE_TASK]  # within the spacing: one pass is enough
    now = timezone.now()
    assert fleet.cold_demand(dep, now, 10.0) == 5
    assert fleet.cold_demand(dep, now + timedelta(seconds=11), 10.0) == 0  # stale
    # An edge that leaves out ``cold`` (an older edge) keeps its last report.
    assert client.post(url, {}, format="json").status_code == 200
    assert fleet.cold_demand(dep, timezone.now(), 10.0) == 5
    # Its last cold model warmed: an empty report clears it.
    assert client.post(url, {"cold": []}, format="json").status_code == 200
    assert Edge.objects.get(pk=edge.pk).cold_demand == {}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "cold",
    [
        [{"model": "m", "held": -1, "arrived": 0}],
        [{"model": "m", "held": 1, "arrived": 1_000_001}],
        [{"model": "m", "held": "1", "arrived": 0}],
        [{"model": "m", "held": 1, "arrived": 0, "extra": 1}],
        [{"model": "m", "held": 1, "arrived": 0}, {"model": "m", "held": 1, "arrived": 0}],
        [{"model": "m" * 201, "held": 1, "arrived": 0}],
        [{"model": f"m{i}", "held": 1, "arrived": 0} for i in range(1001)],
    ],
)
def test_a_bad_cold_report_is_400(cold: list[dict[str, Any]], sent: list[str]) -> None:
    dep = zero_deployment()
    edge, client = edge_of(dep.pool.region)
    r = client.post(f"/api/v1/edges/{edge.name}/heartbeat", {"cold": cold}, format="json")
    assert r.status_code == 400 and "cold" in str(r.json()), r.content
    assert Edge.objects.get(pk=edge.pk).cold_demand == {} and sent == []


@pytest.mark.django_db
def test_one_held_request_wakes_one_deployment_of_the_model_in_its_region() -> None:
    first = zero_deployment()
    region = first.pool.region
    second = make_deployment(
        first.model,
        make_pool(region, "a100", provisioner="local", accelerator="A100-80G"),
        min_replicas=0,
        desired_replicas=0,
        max_replicas=2,
        autoscale=True,
        scale_to_zero_after_s=300,
    )
    edge, _ = edge_of(region)
    now = timezone.now()
    heartbeats.edge_heartbeat_record(
        edge=edge, applied_table_version=None, instances=[], cold={first.model.name: (1, 1)}
    )
    assert fleet.cold_demand(first, now, 10.0) == 2
    assert fleet.cold_demand(second, now, 10.0) == 0
    Deployment.objects.filter(pk=first.pk).update(desired_replicas=1)
    assert fleet.cold_demand(second, now, 10.0) == 0  # the first is already waking


@pytest.mark.django_db
def test_the_announced_cold_start_is_the_last_one_measured(settings: Any) -> None:
    settings.FEDINFER_COLD_START_DEFAULT_SECONDS = 77
    dep = zero_deployment()
    (row,) = cold_rows()
    assert (row.region, row.model, row.cold_start_s) == ("eu-west", dep.model.name, 77.0)
    inst = make_instance(dep, "eu-0", state="ready")
    assert cold_rows() == ()  # a ready instance: not cold
    interval = InstanceInterval.objects.get(instance=inst)
    InstanceInterval.objects.filter(pk=interval.pk).update(
        ready_at=inst.created_at + timedelta(seconds=42)
    )
    inventory.instance_transition(actor=None, instance=inst, state=lifecycle.DRAINING)
    (row,) = cold_rows()
    assert row.cold_start_s == pytest.approx(42.0, abs=0.5)


@pytest.mark.django_db
def test_adapters_are_loadable_where_a_provisioned_ready_replica_runs_their_base() -> None:
    eu, us = make_region("eu-west", "EU"), make_region("us-east", "US")
    model = make_model()
    inventory.adapter_create(actor=None, base_model=model, name="sql-lora", rank=8, source="/a")
    local = make_deployment(model, make_pool(eu, provisioner="local"))
    static = make_deployment(model, make_pool(us))  # run by the operator: nothing to load onto
    assert loadable_adapters() == ()
    make_instance(static, "us-0", state="ready")
    assert loadable_adapters() == ()
    make_instance(local, "eu-0", state="ready")
    assert loadable_adapters() == (("eu-west", "sql-lora"),)
