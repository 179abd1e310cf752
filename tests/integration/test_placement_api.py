"""The placement API against real PostgreSQL: who may plan, a plan writes nothing in the fleet,
apply goes through the inventory services (audited, once, only to the fleet it was made for),
and the worker's reconcile pass then starts the planned replicas (real engine-sim processes)."""

from __future__ import annotations

import time
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.fleet import services as fleet
from federation.fleet.models import PlacementPlan
from federation.fleet.policy import FailoverPolicy, HealthPolicy, Timeouts
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Instance
from federation.metering.models import UsageHour
from tests.integration.fleet_support import engines  # noqa: F401
from tests.integration.inventory_factories import (
    LLAMA_8B,
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)
from workers.provisioners.local import LocalProvisioner

LLAMA = LLAMA_8B["name"]
PLAN, APPLY = "/api/v1/placement/plan/", "/api/v1/placement/apply/"
PLANS = "/api/v1/placement/plans/"
#: One 8B replica on an H100 sustains ~9,400 tokens/s; at 65 % ~6,100.
ONE_REPLICA = 5_000.0


@pytest.fixture
def fleet_rows(db: None) -> dict[str, Any]:
    us, eu = make_region("us-east", "US"), make_region("eu-west", "EU")
    cheap = make_pool(us, "h100", provisioner="local", price_per_gpu_hour=Decimal("2.00"))
    dear = make_pool(eu, "h100", provisioner="local", price_per_gpu_hour=Decimal("4.00"))
    model = make_model()
    dep = make_deployment(model, dear, min_replicas=0, desired_replicas=1, max_replicas=1)
    inventory.region_link_set(actor=None, source=us, target=eu, rtt_ms=75.0)
    inventory.region_link_set(actor=None, source=eu, target=us, rtt_ms=75.0)
    return {"us": us, "eu": eu, "cheap": cheap, "dear": dear, "model": model, "dep": dep}


def fleet_state() -> tuple[list[tuple[Any, ...]], int, int]:
    deps = list(
        Deployment.objects.order_by("pk").values_list(
            "pk",
            "pool_id",
            "tensor_parallel_size",
            "min_replicas",
            "desired_replicas",
            "max_replicas",
        )
    )
    return deps, Instance.objects.count(), AuditEvent.objects.count()


def demand(region: str, tokens: float, tenant: str = "") -> dict[str, Any]:
    return {"model": LLAMA, "region": region, "tokens_per_s": tokens, "tenant": tenant}


def test_only_staff_may_plan_or_apply(
    fleet_rows: dict[str, Any], client_for: Any, make_tenant: Any, make_viewer: Any
) -> None:
    viewer = make_viewer(make_tenant("acme"))
    for client in (client_for(None), client_for(viewer)):
        assert client.post(PLAN, {}, format="json").status_code in (401, 403)
        assert client.post(APPLY, {}, format="json").status_code in (401, 403)
    # A viewer is told what only staff may do, per view.
    said = {
        url: client_for(viewer).generic(method, url, "{}", "application/json").json()["detail"]
        for method, url in (("POST", PLAN), ("POST", APPLY), ("GET", PLANS))
    }
    assert said == {
        PLAN: "Only admins and operators plan the fleet's placement.",
        APPLY: "Only admins and operators apply placement plans.",
        PLANS: "Only admins and operators read placement plans.",
    }
    assert PlacementPlan.objects.count() == 0


def test_input_is_strict_and_bounded(
    fleet_rows: dict[str, Any], operator_client: APIClient
) -> None:
    bad = [
        {"demand": [demand("us-east", 10)], "extra": 1},
        {"demand": [{**demand("us-east", 10), "typo": 1}]},
        {"demand": [demand("us-east", -1)]},
        {"demand": [{**demand("us-east", 10), "tokens_per_s": "10"}]},
        {"demand": [demand("us-east", 1)] * 10_001},
        {"window_hours": 10_000},
    ]
    for body in bad:
        assert operator_client.post(PLAN, body, format="json").status_code == 400, body
    both = {"plan": 1, "demand": [demand("us-east", 10)]}
    assert operator_client.post(APPLY, both, format="json").status_code == 400


def test_demand_from_an_unknown_region_is_refused(
    fleet_rows: dict[str, Any], operator_client: APIClient
) -> None:
    """Found by the API fuzzer (make schemathesis): the planner raised on the region's
    missing residency class, a 500."""
    body = {"demand": [demand("us-east", 10), demand("atlantis", 10)]}
    for url in (PLAN, APPLY):
        r = operator_client.post(url, body, format="json")
        assert r.status_code == 400, r.content
        assert "atlantis" in str(r.json()["demand"])
    assert PlacementPlan.objects.count() == 0


def test_a_plan_is_a_dry_run_and_reports_unserved_demand(
    fleet_rows: dict[str, Any], operator_client: APIClient, make_tenant: Any
) -> None:
    make_tenant("eu-only", allowed_jurisdictions=["EU"])
    before = fleet_state()
    body = {
        "demand": [
            demand("us-east", 3 * ONE_REPLICA),
            demand("eu-west", 10.0, tenant="eu-only"),
            {"model": "nobody/serves-this", "region": "us-east", "tokens_per_s": 5.0},
        ]
    }
    r = operator_client.post(PLAN, body, format="json")
    assert r.status_code == 201, r.content
    doc = r.json()["document"]
    assert fleet_state() == before  # nothing in the fleet, not even an audit event
    changes = {(c["pool"], c["action"], c["after"]) for c in doc["changes"]}
    assert ("us-east/h100", "create", 3) in changes
    assert all(c["pool"] != "eu-west/h100" for c in doc["changes"])  # kept for the EU tenant
    assert doc["unserved"] == [
        {
            "residency_class": "region:us-east",
            "origin": "us-east",
            "model": "nobody/serves-this",
            "tokens_per_s": 5.0,
            "reason": "no_fitting_pool",
        }
    ]
    assert doc["cost"]["usd_per_hour_before"] == 4.0
    assert doc["cost"]["usd_per_hour_after"] == 4.0 + 3 * 2.0
    assert doc["solver"]["status"] == "optimal"


def test_apply_goes_through_the_services_once_and_the_worker_acts(
    fleet_rows: dict[str, Any],
    operator_client: APIClient,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    r = operator_client.post(PLAN, {"demand": [demand("us-east", 2 * ONE_REPLICA)]}, format="json")
    plan_id = r.json()["id"]
    # the EU replica has no demand left: it is removed (desired 0), two are created in the US
    r = operator_client.post(APPLY, {"plan": plan_id}, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["applied_at"] is not None
    created = Deployment.objects.get(pool=fleet_rows["cheap"])
    assert (created.tensor_parallel_size, created.desired_replicas) == (1, 2)
    assert Deployment.objects.get(pk=fleet_rows["dep"].pk).desired_replicas == 0
    actions = list(AuditEvent.objects.order_by("pk").values_list("action", flat=True))
    assert actions.count("fleet.placement.apply") == 1
    assert "deployment.create" in actions and "deployment.update" in actions
    # idempotent: applying it again changes nothing
    state = fleet_state()
    assert operator_client.post(APPLY, {"plan": plan_id}, format="json").status_code == 200
    assert fleet_state() == state
    # the worker's reconcile pass starts what the plan placed
    config = fleet.FleetConfig(
        timeouts=Timeouts(loading_s=30, warming_s=30, drain_s=2),
        health=HealthPolicy(fail_after=2, recover_after=2),
        failover=FailoverPolicy(),
        probe_timeout_s=2,
    )
    deadline = time.monotonic() + 60
    while created.instances.filter(state="ready").count() < 2:
        assert time.monotonic() < deadline, "the planned replicas did not become ready"
        fleet.fleet_reconcile(provisioners={"local": engines}, config=config)
        time.sleep(0.2)
    assert len(engines.running()) == 2


def test_apply_is_refused_when_the_fleet_changed_since_the_plan(
    fleet_rows: dict[str, Any], operator_client: APIClient
) -> None:
    r = operator_client.post(PLAN, {"demand": [demand("us-east", 2 * ONE_REPLICA)]}, format="json")
    inventory.deployment_update(actor=None, deployment=fleet_rows["dep"], data={"max_replicas": 2})
    state = fleet_state()
    r = operator_client.post(APPLY, {"plan": r.json()["id"]}, format="json")
    assert r.status_code == 409, r.content
    assert fleet_state() == state


def heartbeat(instance: Instance, tokens_per_s: float) -> None:
    now = timezone.now()
    report = {
        "tokens_per_s": tokens_per_s,
        "in_flight": 1,
        "queued": 0,
        "kv_cache_usage": 0.1,
        "healthy": True,
        "reported_at": now.isoformat(),
    }
    Instance.objects.filter(pk=instance.pk).update(
        load={
            "tokens_per_s": tokens_per_s,
            "healthy": True,
            "reported_at": now.isoformat(),
            "edges": {"edge-1": report},
        },
        last_heartbeat_at=now,
    )


def test_plan_and_apply_at_once_from_the_edges_heartbeats(
    fleet_rows: dict[str, Any], operator_client: APIClient
) -> None:
    """No usage rolled up: the demand is what the edges report of ready instances, and it
    stays in the region that saw it (no tenant is known), dear as that region is."""
    instance = make_instance(fleet_rows["dep"], "eu-1", "ready")
    heartbeat(instance, 2.5 * ONE_REPLICA)
    r = operator_client.post(APPLY, {}, format="json")
    assert r.status_code == 201, r.content
    doc = r.json()["document"]
    assert [(c["pool"], c["action"], c["after"]) for c in doc["changes"]] == [
        ("eu-west/h100", "resize", 3)
    ]
    assert Deployment.objects.get(pk=fleet_rows["dep"].pk).desired_replicas == 3
    # the traffic stops: nothing is needed any more, the replicas go (min_replicas 0)
    heartbeat(instance, 0.0)
    doc = operator_client.post(PLAN, {}, format="json").json()["document"]
    assert [(c["action"], c["after"]) for c in doc["changes"]] == [("remove", 0)]


def test_usage_rollups_place_each_tenants_tokens_where_its_residency_allows(
    fleet_rows: dict[str, Any], operator_client: APIClient, make_tenant: Any
) -> None:
    """An hour of usage per tenant: the EU tenant's tokens stay in the EU pool (dear), the
    other tenant's go over the region link to the cheap US pool."""
    make_tenant("eu-co", allowed_jurisdictions=["EU"])
    make_tenant("anywhere")
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    tokens = int(2 * ONE_REPLICA * 3600 * 3)  # 2 replicas' worth over the 3-hour window
    for tenant in ("eu-co", "anywhere"):
        UsageHour.objects.create(
            hour=hour,
            tenant=tenant,
            model=LLAMA,
            region="eu-west",
            pool="eu-west/h100",
            requests=1,
            cancelled=0,
            errors=0,
            prompt_tokens=tokens,
            cached_tokens=0,
            completion_tokens=0,
            price_usd=Decimal(0),
            cost_usd=Decimal(0),
        )
    doc = operator_client.post(PLAN, {}, format="json").json()["document"]
    after = {c["pool"]: c["after"] for c in doc["placements"]}
    assert after == {"eu-west/h100": 2, "us-east/h100": 2}, doc
    assert not doc["unserved"]
