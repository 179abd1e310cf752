"""Table distribution: versions, ETag and long-poll, edge credentials, heartbeats, overview.

Runs on the real PostgreSQL and Redis; the long-poll latency is measured against a real
``fedinfer serve`` (uvicorn, ASGI) process on loopback reading the test database.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
import redis
from django.conf import settings
from django.utils import timezone
from rest_framework.test import APIClient

from federation.inventory import services as inventory
from federation.inventory.models import Edge, Instance, Region
from federation.routing import services
from federation.routing.models import BudgetReport, RoutingTableCounter, RoutingTableVersion
from federation.telemetry import heartbeats
from federation.tenancy.keys import hash_key
from federation.tenancy.models import Tenant
from regions.supervisor import Supervisor
from regions.tables import signing
from tests.integration.control_plane_support import own_redis, serve, subprocess_env
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)

REDIS_TEST_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)


@dataclass
class Fleet:
    eu: Region
    us: Region
    eu_edge: Edge
    us_edge: Edge
    eu_credential: str
    us_credential: str


def build_fleet(admin_client: APIClient) -> Fleet:
    """Two regions, a ready instance and an edge in each; credentials issued by the API."""
    eu = make_region("eu-west", "EU", latitude=53.3, longitude=-6.3)
    us = make_region("us-east", "US")
    model = make_model()
    for region in (eu, us):
        dep = make_deployment(model, make_pool(region), tp=1, max_replicas=2)
        make_instance(dep, f"{region.code}-0", state="ready")
    inventory.region_link_set(actor=None, source=eu, target=us, rtt_ms=80.0)
    eu_edge = inventory.edge_register(
        actor=None, region=eu, name="edge-eu-1", url="http://edge-eu.local:8080"
    )
    us_edge = inventory.edge_register(
        actor=None, region=us, name="edge-us-1", url="http://edge-us.local:8080"
    )
    creds = []
    for edge in (eu_edge, us_edge):
        r = admin_client.post(f"/api/v1/edges/{edge.pk}/rotate-credential")
        assert r.status_code == 200, r.content
        assert r.json()["name"] == edge.name
        creds.append(r.json()["credential"])
    return Fleet(eu, us, eu_edge, us_edge, creds[0], creds[1])


def edge_client(credential: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {credential}")
    return client


@pytest.fixture(autouse=True)
def test_redis(settings: Any) -> Iterator[redis.Redis]:
    """Redis DB 14 for the debounce mark, nudges and the broker of this module's tasks (a
    transactional test commits, so its changes queue real recompiles)."""
    with own_redis(settings, REDIS_TEST_URL) as client:
        yield client


@pytest.fixture
def fleet(admin_client: APIClient) -> Fleet:
    return build_fleet(admin_client)


def latest(region: Region) -> RoutingTableVersion:
    return RoutingTableVersion.objects.filter(region=region).order_by("-version").first()


# --- versions ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_versions_increase_and_an_unchanged_fleet_publishes_nothing(fleet: Fleet) -> None:
    first = services.routing_tables_publish()
    assert sorted((v.region.code, v.version) for v in first) == [("eu-west", 1), ("us-east", 1)]
    assert services.routing_tables_publish() == []
    assert services.routing_tables_publish(regions=["eu-west"]) == []

    inventory.region_evacuate(actor=None, region=fleet.eu)
    second = {v.region.code: v for v in services.routing_tables_publish()}
    assert second["eu-west"].version == 2
    assert second["eu-west"].document["instances"] == []
    assert second["eu-west"].document["version"] == 2
    # us-east lost its spill-over region, so its table changed too.
    assert second["us-east"].version == 2
    assert second["us-east"].document["remote_regions"] == []
    assert RoutingTableCounter.objects.get(region_code="eu-west").last_version == 2


@pytest.mark.django_db
def test_a_region_created_again_keeps_counting_up(fleet: Fleet) -> None:
    region = make_region("ap-south", "IN")
    services.routing_tables_publish(regions=["ap-south"])
    inventory.region_delete(actor=None, region=region)
    again = make_region("ap-south", "IN")
    (version,) = services.routing_tables_publish(regions=["ap-south"])
    assert version.region == again
    assert version.version == 2  # an edge holding version 1 accepts it


@pytest.mark.django_db(transaction=True)
def test_concurrent_publishers_never_reuse_or_lower_a_version(admin_client: APIClient) -> None:
    fleet = build_fleet(admin_client)
    services.routing_tables_publish()
    dep = Instance.objects.get(name="eu-west-0").deployment
    inventory.deployment_update(actor=None, deployment=dep, data={"max_replicas": 8})
    errors: list[BaseException] = []
    results: list[list[RoutingTableVersion]] = []

    def publish(i: int) -> None:
        try:
            make_instance(dep, f"eu-west-extra-{i}", state="ready")
            results.append(services.routing_tables_publish(regions=["eu-west"]))
        except BaseException as exc:  # reported below, with the thread's failure
            errors.append(exc)
        finally:
            from django.db import connection

            connection.close()

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    versions = list(
        RoutingTableVersion.objects.filter(region=fleet.eu)
        .order_by("created_at", "id")
        .values_list("version", "document")
    )
    numbers = [v for v, _ in versions]
    assert numbers == sorted(set(numbers)) and numbers[0] == 1
    # Each later version carries at least the instances of the one before.
    counts = [len(doc["instances"]) for _, doc in versions]
    assert counts == sorted(counts) and counts[-1] == 5


# --- fetching ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_etag_and_if_none_match(fleet: Fleet) -> None:
    services.routing_tables_publish()
    client = edge_client(fleet.eu_credential)
    r = client.get("/api/v1/edges/eu-west/routing-table")
    assert r.status_code == 200, r.content
    assert r["ETag"] == '"1"'
    doc = r.json()
    assert doc["version"] == 1 and doc["region"] == "eu-west"
    assert [i["id"] for i in doc["instances"]] == ["eu-west-0"]
    # Signed with the configured key: the edge's verify() accepts it, and nothing else.
    keys = {settings.FEDINFER_TABLE_SIGNING_KEY_ID: settings.FEDINFER_TABLE_SIGNING_KEY}
    assert signing.verify(r.content, keys).version == 1
    with pytest.raises(signing.SignatureError):
        signing.verify({**doc, "version": 9}, keys)
    with pytest.raises(signing.SignatureError):
        signing.verify(r.content, {settings.FEDINFER_TABLE_SIGNING_KEY_ID: "another key"})

    r = client.get("/api/v1/edges/eu-west/routing-table", HTTP_IF_NONE_MATCH='"1"')
    assert r.status_code == 304 and r["ETag"] == '"1"' and r.content == b""
    for etag in ('W/"1"', "1", '"7"'):  # weak, bare, and ahead of us (restored database)
        r = client.get("/api/v1/edges/eu-west/routing-table", HTTP_IF_NONE_MATCH=etag)
        assert r.status_code == 304, etag
    r = client.get("/api/v1/edges/eu-west/routing-table", HTTP_IF_NONE_MATCH='"0"')
    assert r.status_code == 200

    inventory.region_evacuate(actor=None, region=fleet.eu)
    services.routing_tables_publish()
    r = client.get("/api/v1/edges/eu-west/routing-table", HTTP_IF_NONE_MATCH='"1"')
    assert r.status_code == 200 and r["ETag"] == '"2"' and r.json()["instances"] == []


@pytest.mark.django_db
def test_long_poll_without_a_newer_version_answers_304_after_the_wait(fleet: Fleet) -> None:
    services.routing_tables_publish()
    client = edge_client(fleet.eu_credential)
    started = time.monotonic()
    r = client.get("/api/v1/edges/eu-west/routing-table?wait=1", HTTP_IF_NONE_MATCH='"1"')
    elapsed = time.monotonic() - started
    assert r.status_code == 304
    assert 0.9 <= elapsed < 3, elapsed


@pytest.mark.django_db
def test_a_fetch_never_compiles_and_wait_is_bounded(fleet: Fleet) -> None:
    client = edge_client(fleet.eu_credential)
    assert not RoutingTableVersion.objects.filter(region=fleet.eu).exists()
    r = client.get("/api/v1/edges/eu-west/routing-table")
    assert r.status_code == 503 and r["Retry-After"] == "1"
    started = time.monotonic()
    r = client.get("/api/v1/edges/eu-west/routing-table?wait=1")  # waits for the first one
    assert r.status_code == 503 and 0.9 <= time.monotonic() - started < 3
    assert not RoutingTableVersion.objects.exists()
    services.routing_tables_publish()  # what the worker runs after the edge's registration
    r = client.get("/api/v1/edges/eu-west/routing-table")
    assert r.status_code == 200 and r.json()["region"] == "eu-west"
    assert r["ETag"] == f'"{r.json()["version"]}"'
    assert RoutingTableVersion.objects.filter(region=fleet.eu).count() == 1
    for bad in ("31", "-1", "soon"):
        r = client.get(f"/api/v1/edges/eu-west/routing-table?wait={bad}")
        assert r.status_code == 400 and "wait" in r.json(), bad


@pytest.mark.django_db
def test_credentials_decide_who_reads_which_table(
    fleet: Fleet, operator_client: APIClient, make_tenant: Any, make_viewer: Any, client_for: Any
) -> None:
    services.routing_tables_publish()
    url = "/api/v1/edges/eu-west/routing-table"
    assert APIClient().get(url).status_code == 401
    r = edge_client("fe_not-a-real-credential").get(url)
    assert r.status_code == 401 and r["WWW-Authenticate"].startswith("Bearer")
    assert edge_client("some-random-token").get(url).status_code == 401
    r = edge_client(fleet.us_credential).get(url)
    assert r.status_code == 403 and "us-east" in r.json()["detail"]
    assert (
        edge_client(fleet.eu_credential).get("/api/v1/edges/mars-1/routing-table").status_code
        == 404
    )
    assert operator_client.get(url).status_code == 200
    viewer = client_for(make_viewer(make_tenant("acme")))
    assert viewer.get(url).status_code == 403


@pytest.mark.django_db
def test_rotating_a_credential_revokes_the_old_one_and_stores_only_a_hash(
    fleet: Fleet, admin_client: APIClient, operator_client: APIClient
) -> None:
    services.routing_tables_publish()
    r = operator_client.post(f"/api/v1/edges/{fleet.eu_edge.pk}/rotate-credential")
    assert r.status_code == 200
    new = r.json()["credential"]
    stored = Edge.objects.get(pk=fleet.eu_edge.pk).credential_hash
    assert new not in stored and stored == hash_key(new)
    url = "/api/v1/edges/eu-west/routing-table"
    assert edge_client(fleet.eu_credential).get(url).status_code == 401
    assert edge_client(new).get(url).status_code == 200
    assert admin_client.post("/api/v1/edges/999999/rotate-credential").status_code == 404
    for malformed in ("null,null", "0.5", "%00", "99999999999999999999999"):
        # The view's JSON 404, not the URL resolver's HTML page (the API fuzzer).
        r = admin_client.post(f"/api/v1/edges/{malformed}/rotate-credential")
        assert (r.status_code, r["Content-Type"]) == (404, "application/json"), malformed
    # Edge credentials are accepted by the table and heartbeat endpoints only.
    rotate = f"/api/v1/edges/{fleet.eu_edge.pk}/rotate-credential"
    assert edge_client(new).post(rotate).status_code == 401


# --- heartbeats ----------------------------------------------------------------------------


def heartbeat(fleet: Fleet, body: dict[str, Any], *, name: str = "edge-eu-1") -> Any:
    return edge_client(fleet.eu_credential).post(
        f"/api/v1/edges/{name}/heartbeat", body, format="json"
    )


@pytest.mark.django_db
def test_heartbeat_stores_liveness_version_and_instance_load(fleet: Fleet) -> None:
    services.routing_tables_publish()
    r = heartbeat(
        fleet,
        {
            "applied_table_version": 1,
            "instances": [
                {
                    "id": "eu-west-0",
                    "healthy": True,
                    "in_flight": 3,
                    "kv_cache_usage": 0.4,
                    "tokens_per_s": 1200.0,
                },
                {"id": "us-east-0", "healthy": True},
                {"id": "gone-7", "healthy": False},
            ],
        },
    )
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["applied_table_version"] == 1 and body["latest_table_version"] == 1
    assert body["updated_instances"] == ["eu-west-0"]
    # Another region's instance and an unknown one are listed back, not stored.
    assert body["unknown_instances"] == ["gone-7", "us-east-0"]
    edge = Edge.objects.get(pk=fleet.eu_edge.pk)
    assert edge.applied_table_version == 1
    assert edge.last_heartbeat_at is not None
    inst = Instance.objects.get(name="eu-west-0")
    assert inst.load["in_flight"] == 3 and inst.load["healthy"] is True
    assert inst.load["tokens_per_s"] == 1200.0 and inst.last_heartbeat_at == edge.last_heartbeat_at
    assert inst.load["edges"]["edge-eu-1"]["kv_cache_usage"] == 0.4

    assert Instance.objects.get(name="us-east-0").last_heartbeat_at is None

    # A second edge of the region sends the instance more traffic: the demand adds up.
    other = inventory.edge_register(
        actor=None, region=fleet.eu, name="edge-eu-2", url="http://edge-eu-2.local:8080"
    )
    credential = services.edge_credential_rotate(actor=None, edge=other)
    r = edge_client(credential).post(
        "/api/v1/edges/edge-eu-2/heartbeat",
        {"instances": [{"id": "eu-west-0", "healthy": False, "tokens_per_s": 300, "in_flight": 1}]},
        format="json",
    )
    assert r.status_code == 200, r.content
    load = Instance.objects.get(name="eu-west-0").load
    assert load["tokens_per_s"] == 1500.0 and load["in_flight"] == 4
    assert load["healthy"] is True  # edge-eu-1 still admits it
    assert set(load["edges"]) == {"edge-eu-1", "edge-eu-2"}


def test_stale_edge_reports_drop_out_of_an_instances_load() -> None:
    now = timezone.now()
    report = heartbeats.InstanceReport(id="i", healthy=True, load={"tokens_per_s": 10.0})
    stale = heartbeats.merge_load({}, edge="old", report=report, now=now - timedelta(seconds=61))
    fresh = heartbeats.merge_load(stale, edge="new", report=report, now=now)
    assert set(fresh["edges"]) == {"new"} and fresh["tokens_per_s"] == 10.0
    # A malformed snapshot (written by hand through the instance API) is replaced.
    assert heartbeats.merge_load({"edges": "x"}, edge="e", report=report, now=now)["edges"] == {
        "e": {"tokens_per_s": 10.0, "healthy": True, "reported_at": now.isoformat()}
    }


@pytest.mark.django_db
def test_heartbeat_version_going_backwards_is_409_but_liveness_is_kept(fleet: Fleet) -> None:
    services.routing_tables_publish()
    inventory.region_evacuate(actor=None, region=fleet.eu)
    services.routing_tables_publish()
    assert heartbeat(fleet, {"applied_table_version": 2}).status_code == 200
    Edge.objects.filter(pk=fleet.eu_edge.pk).update(last_heartbeat_at=None)
    r = heartbeat(
        fleet,
        {"applied_table_version": 1, "instances": [{"id": "eu-west-0", "healthy": False}]},
    )
    assert r.status_code == 409
    assert r.json()["code"] == "table_version_backwards"
    edge = Edge.objects.get(pk=fleet.eu_edge.pk)
    assert edge.last_heartbeat_at is not None and edge.applied_table_version == 2
    assert Instance.objects.get(name="eu-west-0").last_heartbeat_at is None


@pytest.mark.django_db
def test_heartbeat_bad_input_is_400_naming_the_field(
    fleet: Fleet, operator_client: APIClient
) -> None:
    services.routing_tables_publish()
    cases = [
        ({"applied_table_version": 7}, "applied_table_version"),  # never published
        ({"applied_table_version": "1"}, "applied_table_version"),
        ({"applied_table_version": 0}, "applied_table_version"),
        ({"instances": [{"id": "eu-west-0", "healthy": "yes"}]}, "instances"),
        ({"instances": [{"id": "eu-west-0"}]}, "instances"),
        ({"instances": [{"id": "a", "healthy": True}, {"id": "a", "healthy": True}]}, "instances"),
        ({"instances": [{"id": "a", "healthy": True, "kv_cache_usage": 2}]}, "instances"),
        ({"load": {}}, "load"),
    ]
    for body, field in cases:
        r = heartbeat(fleet, body)
        assert r.status_code == 400, (body, r.content)
        assert field in r.json(), (body, r.json())
    assert Edge.objects.get(pk=fleet.eu_edge.pk).last_heartbeat_at is None
    # Only the edge itself may report for itself.
    assert heartbeat(fleet, {}, name="edge-us-1").status_code == 403
    assert heartbeat(fleet, {}, name="edge-nowhere").status_code == 404
    r = operator_client.post("/api/v1/edges/edge-eu-1/heartbeat", {}, format="json")
    assert r.status_code == 403


@pytest.mark.django_db
def test_overview_shows_each_regions_version_and_the_edges_running_it(
    fleet: Fleet, operator_client: APIClient, django_assert_max_num_queries: Any
) -> None:
    services.routing_tables_publish()
    heartbeat(fleet, {"applied_table_version": 1})
    with django_assert_max_num_queries(6):
        r = operator_client.get("/api/v1/routing-tables/")
    assert r.status_code == 200
    rows = {row["region"]: row for row in r.json()["results"]}
    assert rows["eu-west"]["latest_version"] == 1
    (edge,) = rows["eu-west"]["edges"]
    assert edge["name"] == "edge-eu-1" and edge["applied_table_version"] == 1
    assert 0 <= edge["heartbeat_age_s"] < 60
    assert rows["us-east"]["edges"][0]["heartbeat_age_s"] is None
    r = operator_client.get("/api/v1/routing-tables/eu-west/")
    assert r.status_code == 200 and r.json()["latest_version"] == 1


# --- long-poll against a real ASGI server ---------------------------------------------------


@dataclass
class Server:
    url: str
    redis: str


#: Nothing listens there: the server's Redis is "down" and it must poll the database.
DEAD_REDIS_URL = "redis://127.0.0.1:1/0"


@pytest.fixture
def server(transactional_db: None, procs: Supervisor, request: pytest.FixtureRequest) -> Server:
    """``fedinfer serve`` (uvicorn) on this test's database; ``request.param`` picks its
    Redis: ``"redis"`` (DB 14, nudged by the publisher) or ``"redis-down"``."""
    env = subprocess_env(REDIS_TEST_URL)
    if getattr(request, "param", "redis") == "redis-down":
        env["REDIS_URL"] = DEAD_REDIS_URL
    url, _ = serve(procs, env)
    return Server(url, getattr(request, "param", "redis"))


@pytest.mark.parametrize("server", ["redis", "redis-down"], indirect=True)
@pytest.mark.django_db(transaction=True)
def test_long_poll_answers_as_soon_as_a_version_is_published(
    server: Server, admin_client: APIClient, settings: Any
) -> None:
    settings.REDIS_URL = REDIS_TEST_URL  # the publisher nudges the server's Redis
    fleet = build_fleet(admin_client)
    services.routing_tables_publish()
    url = f"{server.url}/api/v1/edges/eu-west/routing-table"
    headers = {"Authorization": f"Bearer {fleet.eu_credential}", "If-None-Match": '"1"'}
    answer: dict[str, Any] = {}

    def poll() -> None:
        started = time.monotonic()
        r = httpx.get(url, params={"wait": 10}, headers=headers, timeout=20)
        answer.update(response=r, at=time.monotonic(), started=started)

    waiter = threading.Thread(target=poll)
    waiter.start()
    time.sleep(1.0)  # the request is now waiting in the server
    assert not answer, "the long-poll answered before anything was published"
    inventory.region_evacuate(actor=None, region=fleet.eu)
    (version,) = services.routing_tables_publish(regions=["eu-west"])
    # Published: committed and nudged (the compile before it is not the long-poll's to
    # answer for; on a loaded machine it took a good part of a second).
    published_at = time.monotonic()
    waiter.join(timeout=15)
    r = answer["response"]
    assert r.status_code == 200 and r.headers["ETag"] == f'"{version.version}"'
    latency = answer["at"] - published_at
    print(f"long-poll latency after publish ({server.redis}): {latency * 1000:.0f} ms")
    assert latency < 1.0, latency

    # Nothing newer: 304 once the wait is over.
    started = time.monotonic()
    r = httpx.get(
        url,
        params={"wait": 1},
        headers={**headers, "If-None-Match": f'"{version.version}"'},
        timeout=10,
    )
    assert r.status_code == 304 and 0.9 <= time.monotonic() - started < 3


@pytest.mark.django_db
def test_admin_lists_published_versions_read_only(fleet: Fleet, client: Any) -> None:
    from django.contrib.auth.models import User

    services.routing_tables_publish()
    client.force_login(User.objects.create_superuser("root", password="pw-root"))
    r = client.get("/admin/routing/routingtableversion/")
    assert r.status_code == 200 and b"eu-west" in r.content
    table = latest(fleet.eu)
    assert client.post(f"/admin/routing/routingtableversion/{table.pk}/delete/").status_code == 403


# --- budget leases -------------------------------------------------------------------------


def budget_leases_of(region: Region) -> dict[str, list[int]]:
    """edge -> [counted, lease, prior] of tenant acme's budget in the region's latest table."""
    doc = latest(region).document
    (acme,) = [t for t in doc["tenants"] if t["tenant"] == "acme"]
    return acme["budget"]["tenant"]["leases"]


@pytest.mark.django_db
def test_an_edge_that_reports_it_uses_none_of_its_lease_gives_it_back(
    fleet: Fleet, make_tenant: Callable[..., Tenant]
) -> None:
    """The eu edge reports, on the table that granted it a quarter of the budget, that it has
    committed nothing: the next table takes back half of that (keeping what it may still spend
    under as ``prior``) and adds its share of what nobody holds; the one after grants what it
    gave back to the others."""
    tenant = make_tenant("acme", monthly_budget_usd=Decimal("100.00"))
    tenant.allowed_regions.add(fleet.eu, fleet.us)
    services.routing_tables_publish()
    quarter = 25 * 10**12
    first = budget_leases_of(fleet.eu)
    assert first == {"edge-eu-1": [0, quarter, 0], "edge-us-1": [0, quarter, 0]}
    assert budget_leases_of(fleet.us) == first  # every region's table carries every tenant

    r = heartbeat(fleet, {"applied_table_version": latest(fleet.eu).version, "budgets": []})
    assert r.status_code == 200, r.content
    services.routing_tables_publish()
    second = budget_leases_of(fleet.eu)
    # Half of its unused quarter taken back, plus a fresh even share of what nobody holds:
    # (100 - 25 - 25) / 2 / 2.
    assert second["edge-eu-1"] == [0, quarter // 2 + quarter // 2, quarter]
    assert second["edge-us-1"] == [0, quarter + quarter // 2, quarter]

    # A report on an older table takes nothing back.
    heartbeat(fleet, {"applied_table_version": latest(fleet.eu).version - 1, "budgets": []})
    services.routing_tables_publish()
    assert budget_leases_of(fleet.eu)["edge-eu-1"][2] == quarter

    r = heartbeat(
        fleet,
        {
            "applied_table_version": latest(fleet.eu).version,
            "budgets": [{"tenant": "acme", "key": "", "committed": 3 * 10**12}],
        },
    )
    assert r.status_code == 200, r.content
    services.routing_tables_publish()
    third = budget_leases_of(fleet.eu)
    holds = {edge: max(counted + lease, prior) for edge, (counted, lease, prior) in third.items()}
    assert third["edge-eu-1"][1] >= 3 * 10**12  # never below what it committed
    assert sum(holds.values()) <= 100 * 10**12


@pytest.mark.django_db
def test_a_heartbeat_with_a_malformed_budget_report_is_refused_whole(fleet: Fleet) -> None:
    services.routing_tables_publish()
    bad = {"tenant": "acme", "key": "", "committed": -1}
    r = heartbeat(fleet, {"applied_table_version": 1, "budgets": [bad]})
    assert r.status_code == 400
    assert "budgets" in r.text
    assert not BudgetReport.objects.exists()
