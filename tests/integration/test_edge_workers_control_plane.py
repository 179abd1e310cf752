"""An edge of several worker processes (``fedinfer edge --workers``) as the control plane sees
it: one registered edge; each worker's load and cold demand kept apart and added up; each a
holder of budget leases and one of the region's edges for rate-limit shares."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
import redis
from rest_framework.test import APIClient

from federation.inventory.models import Edge, Instance
from federation.routing import services
from federation.routing.models import BudgetReport
from federation.tenancy.models import Tenant
from tests.integration.control_plane_support import own_redis
from tests.integration.test_routing_distribution import (
    REDIS_TEST_URL,
    Fleet,
    budget_leases_of,
    build_fleet,
    edge_client,
    latest,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def test_redis(settings: Any) -> Iterator[redis.Redis]:
    with own_redis(settings, REDIS_TEST_URL) as client:
        yield client


@pytest.fixture
def fleet(admin_client: APIClient) -> Fleet:
    return build_fleet(admin_client)


def beat(fleet: Fleet, worker: int, workers: int, **body: Any) -> Any:
    return edge_client(fleet.eu_credential).post(
        "/api/v1/edges/edge-eu-1/heartbeat",
        {"worker": worker, "workers": workers, **body},
        format="json",
    )


def test_each_worker_reports_its_own_load_and_the_region_counts_its_processes(
    fleet: Fleet, make_tenant: Callable[..., Tenant]
) -> None:
    services.routing_tables_publish()
    older = latest(fleet.eu).version
    tenant = make_tenant("acme", monthly_budget_usd=Decimal("100.00"))
    tenant.allowed_regions.add(fleet.eu, fleet.us)
    services.routing_tables_publish()
    first = latest(fleet.eu).version
    assert first > older
    assert "local_edges" not in latest(fleet.eu).document  # one edge, one process

    r = beat(
        fleet, 0, 2, applied_table_version=first,
        instances=[{"id": "eu-west-0", "healthy": True, "tokens_per_s": 100.0, "in_flight": 1}],
    )  # fmt: skip
    assert r.status_code == 200, r.content
    # Worker 1 still serves an older table (each worker syncs its own): its load counts, and
    # its version is not a step backwards of the edge's.
    r = beat(
        fleet, 1, 2, applied_table_version=older,
        instances=[{"id": "eu-west-0", "healthy": True, "tokens_per_s": 50.0, "in_flight": 2}],
        budgets=[{"tenant": "acme", "key": "", "committed": 7}],
    )  # fmt: skip
    assert r.status_code == 200, r.content
    edge = Edge.objects.get(pk=fleet.eu_edge.pk)
    assert edge.workers == 2 and edge.applied_table_version == first
    # Each worker's budget report is its own, under the table it applied.
    reports = {r.holder: (r.table_version, r.committed) for r in BudgetReport.objects.all()}
    assert reports == {"edge-eu-1": (first, {}), "edge-eu-1.1": (older, {"acme": {"": 7}})}
    load = Instance.objects.get(name="eu-west-0").load
    assert set(load["edges"]) == {"edge-eu-1", "edge-eu-1.1"}
    assert load["tokens_per_s"] == 150.0 and load["in_flight"] == 3

    services.routing_tables_publish()
    table = latest(fleet.eu).document
    assert table["local_edges"] == 2  # two processes share every rate limit
    leases = budget_leases_of(fleet.eu)
    assert set(leases) == {"edge-eu-1", "edge-eu-1.1", "edge-us-1"}
    holds = [max(counted + lease, prior) for counted, lease, prior in leases.values()]
    assert sum(holds) <= 100 * 10**12
    assert leases["edge-eu-1.1"][1] > 0  # the new worker got a lease of its own

    # The edge runs one worker again: the next table counts one process and leases nothing
    # new to the gone worker (it keeps what it may still be spending under, as any edge).
    assert beat(fleet, 0, 1, applied_table_version=latest(fleet.eu).version).status_code == 200
    services.routing_tables_publish()
    assert "local_edges" not in latest(fleet.eu).document
    counted, lease, _ = budget_leases_of(fleet.eu).get("edge-eu-1.1", (0, 0, 0))
    assert counted + lease <= leases["edge-eu-1.1"][0] + leases["edge-eu-1.1"][1]


def test_a_worker_that_does_not_exist_is_refused(fleet: Fleet) -> None:
    for worker, workers in [(2, 2), (0, 0), (0, 33), (-1, 2)]:
        r = beat(fleet, worker, workers)
        assert r.status_code == 400, (worker, workers, r.content)
        assert set(r.json()) & {"worker", "workers"}, r.json()
    assert Edge.objects.get(pk=fleet.eu_edge.pk).last_heartbeat_at is None


def test_cold_demand_adds_up_over_the_workers(fleet: Fleet) -> None:
    services.routing_tables_publish()
    version = latest(fleet.eu).version
    cold = [{"model": "llama-cold", "held": 2, "arrived": 3}]
    assert beat(fleet, 1, 2, cold=cold).status_code == 200
    assert beat(fleet, 0, 2, applied_table_version=version, cold=[]).status_code == 200
    entry = Edge.objects.get(pk=fleet.eu_edge.pk).cold_demand["llama-cold"]
    assert (entry["held"], entry["arrived"]) == (2, 3)  # worker 0's empty report kept worker 1's
    assert set(entry["holders"]) == {"edge-eu-1.1"}
    cold = [{"model": "llama-cold", "held": 1, "arrived": 0}]
    assert beat(fleet, 0, 2, applied_table_version=version, cold=cold).status_code == 200
    entry = Edge.objects.get(pk=fleet.eu_edge.pk).cold_demand["llama-cold"]
    assert (entry["held"], entry["arrived"]) == (3, 3)
    assert beat(fleet, 1, 2, cold=[]).status_code == 200
    entry = Edge.objects.get(pk=fleet.eu_edge.pk).cold_demand["llama-cold"]
    assert (entry["held"], entry["arrived"]) == (1, 0)


def test_a_stopped_workers_cold_report_ages_out() -> None:
    from django.utils import timezone

    from federation.routing.selectors import LOAD_REPORT_MAX_AGE_S
    from federation.telemetry.wake import cold_demand_store

    edge = Edge(name="e", cold_demand={})
    edge.save = lambda **_: None  # type: ignore[method-assign]  (a row is not needed here)
    then = timezone.now()
    cold_demand_store(edge, {"m": (4, 0)}, then, "e.1")
    later = then + timedelta(seconds=LOAD_REPORT_MAX_AGE_S + 1)
    cold_demand_store(edge, {"m": (1, 0)}, later, "e")
    assert edge.cold_demand["m"]["held"] == 1 and set(edge.cold_demand["m"]["holders"]) == {"e"}


def test_a_workers_unused_ceiling_is_taken_back_from_its_own_report(
    fleet: Fleet, make_tenant: Callable[..., Tenant]
) -> None:
    """Worker 1 reports, on the table that leased it a ceiling, that it committed nothing: the
    next table lowers its ceiling (half of it kept as ``prior``) as it would a lone edge's."""
    tenant = make_tenant("acme", monthly_budget_usd=Decimal("100.00"))
    tenant.allowed_regions.add(fleet.eu, fleet.us)
    beat(fleet, 0, 2)
    beat(fleet, 1, 2)
    services.routing_tables_publish()
    granted = budget_leases_of(fleet.eu)["edge-eu-1.1"]
    assert granted[1] > 0
    version = latest(fleet.eu).version
    assert beat(fleet, 1, 2, applied_table_version=version, budgets=[]).status_code == 200
    services.routing_tables_publish()
    leases = budget_leases_of(fleet.eu)
    counted, lease, prior = leases["edge-eu-1.1"]
    assert counted == 0 and prior == granted[1]  # it may spend under the old one until applied
    # Like every holder it gets a share of what nobody holds; unlike the others, which did
    # not report, it keeps only half of its unused ceiling.
    share = leases["edge-us-1"][1] - granted[1]
    assert share > 0 and abs(lease - (granted[1] // 2 + share)) <= 1

    # A version never published for the region is refused, whichever worker sends it.
    r = beat(fleet, 1, 2, applied_table_version=version + 50)
    assert r.status_code == 400 and "applied_table_version" in r.json()


def test_a_change_in_the_number_of_workers_recompiles_soon(
    fleet: Fleet, django_capture_on_commit_callbacks: Any
) -> None:
    """A new worker is leased budgets and counted in the rate-limit shares at the next
    (debounced) compile, not the next periodic one."""
    with django_capture_on_commit_callbacks() as callbacks:
        assert beat(fleet, 1, 3).status_code == 200
    assert services.routing_tables_schedule_recompile in callbacks
    with django_capture_on_commit_callbacks() as callbacks:
        assert beat(fleet, 0, 3).status_code == 200  # the same count: nothing to do
    assert services.routing_tables_schedule_recompile not in callbacks
