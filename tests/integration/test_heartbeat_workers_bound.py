"""A heartbeat's ``workers`` is a claim the control plane bounds by the edge's configured
``max_workers``: each worker is a budget-lease holder and one share of every rate limit, so an
edge credential claiming 32 workers must not shrink its region's other edges to 1/(n+31)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.inventory import services as inventory
from federation.inventory.models import DEFAULT_EDGE_MAX_WORKERS, Edge
from federation.routing import services
from federation.tenancy.models import Tenant
from regions.tables.schema import MAX_EDGE_WORKERS
from tests.integration.control_plane_support import own_redis
from tests.integration.test_routing_distribution import (
    Fleet,
    budget_leases_of,
    build_fleet,
    edge_client,
    latest,
)

pytestmark = pytest.mark.django_db

#: This module's Redis DB (the debounce mark and the broker of the recompiles it queues).
REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)


@pytest.fixture(autouse=True)
def test_redis(settings: Any) -> Iterator[redis.Redis]:
    with own_redis(settings, REDIS_URL) as client:
        yield client


@pytest.fixture
def fleet(admin_client: APIClient) -> Fleet:
    return build_fleet(admin_client)


def honest_second_eu_edge(admin_client: APIClient, fleet: Fleet) -> str:
    """A second edge of the eu region, registered and credentialed through the API."""
    r = admin_client.post(
        "/api/v1/edges/",
        {"region": fleet.eu.code, "name": "edge-eu-2", "url": "http://edge-eu-2.local:8080"},
        format="json",
    )
    assert r.status_code == 201, r.content
    assert r.json()["max_workers"] == DEFAULT_EDGE_MAX_WORKERS
    r = admin_client.post(f"/api/v1/edges/{r.json()['id']}/rotate-credential")
    assert r.status_code == 200, r.content
    return str(r.json()["credential"])


def beat(credential: str, edge: str, worker: int, workers: int) -> Any:
    return edge_client(credential).post(
        f"/api/v1/edges/{edge}/heartbeat", {"worker": worker, "workers": workers}, format="json"
    )


def clamped_count(edge: str) -> float:
    value = REGISTRY.get_sample_value("fedinfer_cp_heartbeat_workers_clamped_total", {"edge": edge})
    return value or 0.0


def test_a_claim_of_32_workers_is_clamped_to_the_configured_bound(
    admin_client: APIClient, fleet: Fleet, make_tenant: Callable[..., Tenant]
) -> None:
    tenant = make_tenant("acme", monthly_budget_usd=Decimal("100.00"))
    tenant.allowed_regions.add(fleet.eu, fleet.us)
    second = honest_second_eu_edge(admin_client, fleet)
    assert beat(second, "edge-eu-2", 0, 1).status_code == 200

    # The operator says edge-eu-1 runs (at most) two workers.
    r = admin_client.patch(f"/api/v1/edges/{fleet.eu_edge.pk}/", {"max_workers": 2}, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["max_workers"] == 2
    before = clamped_count("edge-eu-1")

    # Its credential claims the most the heartbeat schema allows: 2 are believed.
    r = beat(fleet.eu_credential, "edge-eu-1", 0, MAX_EDGE_WORKERS)
    assert r.status_code == 200, r.content
    assert Edge.objects.get(name="edge-eu-1").workers == 2
    assert clamped_count("edge-eu-1") == before + 1
    # A worker beyond the bound holds no lease and no share: refused, naming the field.
    r = beat(fleet.eu_credential, "edge-eu-1", 5, MAX_EDGE_WORKERS)
    assert r.status_code == 400 and "max_workers" in r.json()["worker"][0], r.content

    services.routing_tables_publish()
    # The region's rate limits are shared over 3 processes (2 + the honest edge), not 33:
    # edge-eu-2 keeps a third of each tenant's limit.
    assert latest(fleet.eu).document["local_edges"] == 3
    holders = set(budget_leases_of(fleet.eu))
    assert holders == {"edge-eu-1", "edge-eu-1.1", "edge-eu-2", "edge-us-1"}


def test_without_configuration_the_default_bound_holds(fleet: Fleet) -> None:
    assert beat(fleet.eu_credential, "edge-eu-1", 0, MAX_EDGE_WORKERS).status_code == 200
    assert Edge.objects.get(name="edge-eu-1").workers == DEFAULT_EDGE_MAX_WORKERS
    services.routing_tables_publish()
    assert latest(fleet.eu).document["local_edges"] == DEFAULT_EDGE_MAX_WORKERS
    # Within the bound a claim is believed as before.
    assert beat(fleet.eu_credential, "edge-eu-1", 0, 3).status_code == 200
    assert Edge.objects.get(name="edge-eu-1").workers == 3


def test_lowering_max_workers_clamps_what_was_believed_and_is_audited(
    admin_client: APIClient, fleet: Fleet
) -> None:
    assert beat(fleet.eu_credential, "edge-eu-1", 0, 6).status_code == 200
    r = admin_client.patch(f"/api/v1/edges/{fleet.eu_edge.pk}/", {"max_workers": 4}, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["workers"] == 4
    event = AuditEvent.objects.filter(action="edge.update").latest("id")
    assert event.changes["max_workers"] == [DEFAULT_EDGE_MAX_WORKERS, 4]
    assert event.changes["workers"] == [6, 4]
    for bad in (0, MAX_EDGE_WORKERS + 1):
        r = admin_client.patch(
            f"/api/v1/edges/{fleet.eu_edge.pk}/", {"max_workers": bad}, format="json"
        )
        assert r.status_code == 400 and "max_workers" in r.json(), r.content


def test_an_edge_registered_with_a_larger_bound_is_believed_up_to_it(fleet: Fleet) -> None:
    inventory.edge_update(actor=None, edge=fleet.eu_edge, data={"max_workers": 16})
    assert beat(fleet.eu_credential, "edge-eu-1", 15, 16).status_code == 200
    assert Edge.objects.get(name="edge-eu-1").workers == 16
