"""The control plane's and the worker's Prometheus metrics: who may read ``/metrics``, and every
family's values after real actions (tables compiled and published, heartbeats, usage ingested
from the Redis stream), on PostgreSQL and Redis; a real ``fedinfer worker`` scraped on its port."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from django.conf import settings
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from federation.inventory.models import Deployment, Region
from federation.metering.models import UsageDeadLetter
from federation.metering.pricing import Price
from federation.metering.rollups import usage_hours_refresh
from federation.metering.selectors import tenant_month_spend
from federation.metering.services import model_price_set
from federation.routing import services
from federation.routing.models import RoutingTableVersion
from federation.tenancy.models import Tenant
from regions.supervisor import Supervisor, free_port, wait_until
from regions.tables.usage import USAGE_STREAM, USAGE_STREAM_MAX_ENTRIES, encode_record
from regions.tables.usage import UsageRecord as Doc
from tests.integration.control_plane_support import FEDINFER, own_redis, subprocess_env
from tests.integration.test_routing_distribution import Fleet, build_fleet, heartbeat
from tests.integration.usage_stream_support import STREAM_EDGE, signed, stream_edge
from workers.tasks import usage_ingest_task

Labels = dict[str, str]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def scrape(client: Client | None = None) -> str:
    r = (client or Client()).get("/metrics")
    assert r.status_code == 200, r.content
    assert r["Content-Type"].startswith("text/plain; version=")
    return r.content.decode()


@pytest.fixture
def own_redis_db(settings: Any) -> Iterator[redis.Redis]:
    """This run's Redis DB (``REDIS_URL``) for the broker, the nudges and the usage stream."""
    with own_redis(settings, settings.REDIS_URL) as client:
        yield client


# --- who may read /metrics -------------------------------------------------------------------


@pytest.mark.django_db
def test_metrics_answer_loopback_without_a_token_and_only_the_token_with_one(
    settings: Any,
) -> None:
    settings.FEDINFER_METRICS_TOKEN = ""
    assert Client().get("/metrics").status_code == 200  # the test client is 127.0.0.1
    assert Client(REMOTE_ADDR="::1").get("/metrics").status_code == 200
    remote = Client(REMOTE_ADDR="203.0.113.9").get("/metrics")
    assert remote.status_code == 403 and remote.json()["code"] == "metrics_forbidden"
    # Behind one trusted proxy on loopback, the client is the address the proxy saw.
    settings.FEDINFER_TRUSTED_PROXIES = 1
    proxied = Client(HTTP_X_FORWARDED_FOR="203.0.113.9").get("/metrics")
    assert proxied.status_code == 403
    settings.FEDINFER_TRUSTED_PROXIES = 0

    settings.FEDINFER_METRICS_TOKEN = "s3cret-token"
    refused = Client().get("/metrics")  # loopback no longer suffices
    assert refused.status_code == 403 and refused["WWW-Authenticate"] == 'Bearer realm="metrics"'
    wrong = Client(REMOTE_ADDR="203.0.113.9", HTTP_AUTHORIZATION="Bearer s3cret-tokem")
    assert wrong.get("/metrics").status_code == 403
    right = Client(REMOTE_ADDR="203.0.113.9", HTTP_AUTHORIZATION="Bearer s3cret-token")
    assert right.get("/metrics").status_code == 200
    assert right.post("/metrics").status_code == 405


@pytest.mark.django_db
def test_metrics_answer_staff_sessions_only(
    settings: Any, admin_user: Any, make_tenant: Callable[..., Tenant], make_viewer: Any
) -> None:
    settings.FEDINFER_METRICS_TOKEN = "s3cret-token"
    staff = Client(REMOTE_ADDR="203.0.113.9")
    staff.force_login(admin_user)
    scrape(staff)
    viewer = Client(REMOTE_ADDR="203.0.113.9")
    viewer.force_login(make_viewer(make_tenant("acme")))
    assert viewer.get("/metrics").status_code == 403


# --- request metrics -------------------------------------------------------------------------


@pytest.mark.django_db
def test_requests_are_counted_by_url_pattern_never_by_raw_path(admin_client: APIClient) -> None:
    route = "api/v1/regions/(?P<code>[^/]+)/$"
    before = scrape()
    for code in ("nowhere-1", "nowhere-2", "nowhere-3"):
        assert admin_client.get(f"/api/v1/regions/{code}/").status_code == 404
    assert Client().get("/no/such/page-7").status_code == 404
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        return (value(after, name, **labels) or 0) - (value(before, name, **labels) or 0)

    assert delta("fedinfer_cp_http_requests_total", method="GET", route=route, status="404") == 3
    assert delta("fedinfer_cp_http_request_duration_seconds_count", route=route) == 3
    unmatched = {"method": "GET", "route": "<unmatched>", "status": "404"}
    assert delta("fedinfer_cp_http_requests_total", **unmatched) == 1
    assert "nowhere-1" not in after and "page-7" not in after


# --- the fleet's families after real actions -------------------------------------------------


@pytest.mark.django_db
def test_table_heartbeat_and_instance_families_follow_the_fleet(
    own_redis_db: redis.Redis,
    admin_client: APIClient,
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    fleet: Fleet = build_fleet(admin_client)
    before = scrape()
    with django_capture_on_commit_callbacks(execute=True):
        services.routing_tables_publish()
    text = scrape()
    for code in ("eu-west", "us-east"):
        assert value(text, "fedinfer_cp_table_version", region=code) == 1
        published = value(text, "fedinfer_cp_table_publish_total", region=code)
        assert published == (value(before, "fedinfer_cp_table_publish_total", region=code) or 0) + 1
        assert value(text, "fedinfer_cp_instances", region=code, state="ready") == 1
        assert value(text, "fedinfer_cp_instances", region=code, state="failed") == 0
    compiles = value(text, "fedinfer_cp_table_compile_seconds_count") or 0
    assert compiles == (value(before, "fedinfer_cp_table_compile_seconds_count") or 0) + 1
    for edge, code in (("edge-eu-1", "eu-west"), ("edge-us-1", "us-east")):
        labels = {"edge": edge, "region": code}
        assert value(text, "fedinfer_cp_edge_heartbeat_age_seconds", **labels) == math.inf
        assert value(text, "fedinfer_cp_edge_table_versions_behind", **labels) == 1

    # The EU edge heartbeats version 1 with more demand than the fleet can serve.
    demand = {"id": "eu-west-0", "healthy": True, "tokens_per_s": 5e7}
    r = heartbeat(fleet, {"applied_table_version": 1, "instances": [demand]})
    assert r.status_code == 200, r.content
    text = scrape()
    eu = {"edge": "edge-eu-1", "region": "eu-west"}
    assert value(text, "fedinfer_cp_edge_table_versions_behind", **eu) == 0
    assert 0 <= (value(text, "fedinfer_cp_edge_heartbeat_age_seconds", **eu) or -1) < 5
    solves = value(text, "fedinfer_cp_demand_split_solve_seconds_count") or 0
    with django_capture_on_commit_callbacks(execute=True):
        services.routing_tables_publish()
    text = scrape()
    assert value(text, "fedinfer_cp_demand_split_solve_seconds_count") == solves + 1
    assert value(text, "fedinfer_cp_table_version", region="eu-west") == 2
    assert value(text, "fedinfer_cp_edge_table_versions_behind", **eu) == 1
    # What the split could not place is what the new table says is unserved.
    table = RoutingTableVersion.objects.get(region=fleet.eu, version=2).document
    (route,) = table["routes"]
    assert route["unserved_tokens_per_s"] > 0
    unserved = value(text, "fedinfer_cp_unserved_demand_tokens_per_second", model=route["model"])
    assert unserved == pytest.approx(route["unserved_tokens_per_s"])


def _usage(model: str, tenant: str, i: int) -> bytes:
    return encode_record(
        Doc(
            request_id=f"metrics-{i}",
            started_at=(timezone.now() - timedelta(seconds=30 + i)).timestamp(),
            region="eu-west",
            entry_region="eu-west",
            instance="eu-west-0",
            model=model,
            tenant=tenant,
            key_prefix="fi_abc",
            prompt_tokens=100_000,
            cached_tokens=0,
            completion_tokens=50_000,
            duration_ms=900.0,
            edge=STREAM_EDGE,
        )
    )


@pytest.mark.django_db
def test_ingest_lag_rejections_and_budget_ratio_after_ingestion(
    own_redis_db: redis.Redis, admin_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    build_fleet(admin_client)
    model = Deployment.objects.select_related("model").first().model  # type: ignore[union-attr]
    model_price_set(
        actor=None,
        model=model,
        price=Price(Decimal("1.00"), Decimal("0.10"), Decimal("2.00")),
        effective_from=timezone.now() - timedelta(days=40),
    )
    make_tenant("acme", monthly_budget_usd=Decimal("0.50"))
    make_tenant("globex")  # no budget: no series
    stream_edge(Region.objects.get(code="eu-west"))
    assert value(scrape(), "fedinfer_cp_usage_ingest_lag_seconds") == 0

    # Two shipments, the oldest two minutes old, and an entry that is no usage at all.
    old_ms = int((time.time() - 120) * 1000)
    own_redis_db.xadd(USAGE_STREAM, signed(_usage(model.name, "acme", 1)), id=f"{old_ms}-0")
    own_redis_db.xadd(USAGE_STREAM, signed(_usage(model.name, "acme", 2)))
    own_redis_db.xadd(USAGE_STREAM, {b"not-usage": b"x"})
    before = scrape()
    assert 119 < (value(before, "fedinfer_cp_usage_ingest_lag_seconds") or 0) < 180
    assert value(before, "fedinfer_cp_usage_stream_entries") == 3
    assert value(before, "fedinfer_cp_usage_stream_max_entries") == USAGE_STREAM_MAX_ENTRIES
    assert value(before, "fedinfer_cp_usage_dead_letters") == 0
    assert usage_ingest_task.apply().get() == 2
    usage_hours_refresh()
    after = scrape()
    assert value(after, "fedinfer_cp_usage_ingest_lag_seconds") == 0
    rejected = value(after, "fedinfer_cp_usage_rejected_total") or 0
    assert rejected == (value(before, "fedinfer_cp_usage_rejected_total") or 0) + 1
    assert UsageDeadLetter.objects.count() == 1
    assert value(after, "fedinfer_cp_usage_dead_letters") == 1
    assert value(after, "fedinfer_cp_usage_stream_entries") == 0
    assert value(after, "fedinfer_cp_usage_stream_pending") == 0
    spent = tenant_month_spend(now=timezone.now())["acme"]
    assert spent > 0
    ratio = value(after, "fedinfer_cp_tenant_budget_used_ratio", tenant="acme")
    assert ratio == pytest.approx(float(spent) / 0.50)
    assert value(after, "fedinfer_cp_tenant_budget_used_ratio", tenant="globex") is None


# --- a real worker ---------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_real_worker_serves_task_metrics_from_its_pool_processes(
    procs: Supervisor, own_redis_db: redis.Redis, admin_client: APIClient
) -> None:
    build_fleet(admin_client)
    port = free_port()
    env = {
        **subprocess_env(settings.REDIS_URL),
        "FEDINFER_WORKER_METRICS_PORT": str(port),
        "FEDINFER_TABLES_REFRESH_SECONDS": "1",
    }
    # The default prefork pool: tasks run in a child process, the server in the main one.
    argv = [FEDINFER, "worker", "--concurrency", "1", "--without-gossip", "--without-mingle"]
    worker = procs.start("worker", argv, env=env)
    url = f"http://127.0.0.1:{port}/metrics"
    publish = {"task": "fedinfer.routing_tables.publish", "outcome": "success"}
    seen: dict[str, str] = {}

    def published() -> bool:
        # One scrape is not atomic across families: the pool process writes a task's count,
        # then its duration, each in its own file, and a scrape between the two reads the
        # count ahead (CI, 2026-12-03: 2 publishes counted, 1 duration). Wait for all three.
        try:
            text = seen["text"] = httpx.get(url, timeout=2).text
        except httpx.HTTPError:
            return False
        counts = (
            value(text, "fedinfer_worker_tasks_total", **publish),
            value(text, "fedinfer_worker_task_duration_seconds_count", task=publish["task"]),
            value(text, "fedinfer_cp_table_compile_seconds_count"),
        )
        return all((n or 0) >= 2 for n in counts)

    wait_until(published, what="two periodic publishes counted and timed", timeout=60, watch=worker)
    text = seen["text"]
    # The control-plane counters the worker's compiles updated, summed across its processes.
    assert value(text, "fedinfer_cp_table_publish_total", region="eu-west") == 1
    assert "fedinfer_cp_edge_heartbeat_age_seconds" not in text  # the web's gauges only
    log = Path(worker.log).read_text()
    assert f"worker metrics on http://127.0.0.1:{port}/metrics" in log


# --- health endpoints ------------------------------------------------------------------------


@pytest.mark.django_db
def test_liveness_reads_nothing_and_readiness_needs_the_database(monkeypatch: Any) -> None:
    from django.db import OperationalError, connection

    remote = Client(REMOTE_ADDR="203.0.113.9")  # probes come from anywhere
    assert remote.get("/healthz").json() == {"status": "ok"}
    assert remote.get("/readyz").json() == {"status": "ok"}

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(connection, "cursor", unreachable)
    down = remote.get("/readyz")
    assert down.status_code == 503 and down.json()["database"] == "OperationalError"
    assert remote.get("/healthz").status_code == 200


@pytest.mark.django_db(transaction=True)
def test_workers_without_beat_and_one_beat_run_the_schedule_once(
    procs: Supervisor, own_redis_db: redis.Redis, admin_client: APIClient
) -> None:
    """The Kubernetes layout: workers ``--no-beat`` run nothing periodic by themselves; one
    ``fedinfer beat`` queues the periodic publish, which the workers run."""
    build_fleet(admin_client)
    port = free_port()
    env = {
        **subprocess_env(settings.REDIS_URL),
        "FEDINFER_WORKER_METRICS_PORT": str(port),
        "FEDINFER_TABLES_REFRESH_SECONDS": "1",
    }
    argv = [FEDINFER, "worker", "--no-beat", "--pool", "solo", "--without-gossip"]
    worker = procs.start("worker", [*argv, "--without-mingle"], env=env)
    url = f"http://127.0.0.1:{port}/metrics"
    publish = {"task": "fedinfer.routing_tables.publish", "outcome": "success"}

    def publishes() -> float:
        try:
            return (
                value(httpx.get(url, timeout=2).text, "fedinfer_worker_tasks_total", **publish) or 0
            )
        except httpx.HTTPError:
            return -1

    # The fleet's changes queued debounced recompiles (one, or another if a change committed
    # after the first had started): the worker runs them, then the count stays put.
    wait_until(lambda: publishes() >= 1, what="the queued recompile", timeout=60, watch=worker)
    settled = _settled(publishes, quiet_s=1.5)
    time.sleep(3)  # three refresh intervals: a worker without beat queues nothing more
    assert publishes() == settled
    assert "beat: Starting" not in Path(worker.log).read_text()
    beat = procs.start("beat", [FEDINFER, "beat"], env=env)
    wait_until(
        lambda: publishes() >= 3, what="beat's publishes run", timeout=60, watch=[worker, beat]
    )


def _settled(read: Any, quiet_s: float, timeout_s: float = 30.0) -> float:
    """``read()`` once it has not changed for ``quiet_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return float(last)
    raise AssertionError(f"still changing after {timeout_s:.0f}s: {last}")


@pytest.mark.django_db
def test_probes_and_scrapes_are_not_redirected_to_https(settings: Any) -> None:
    """Behind a TLS proxy that redirects, kubelet and Prometheus still reach the pod over
    HTTP: these three paths answer, everything else is redirected."""
    settings.SECURE_SSL_REDIRECT = True
    client = Client()
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    assert client.get("/metrics").status_code == 200
    redirected = client.get("/api/v1/")
    assert redirected.status_code == 301 and redirected["Location"].startswith("https://")


def test_a_worker_metrics_port_without_the_sample_folder_stops_the_boot(
    settings: Any, monkeypatch: Any
) -> None:
    """Pool processes' counts would be lost without multiprocess mode: refused, not served."""
    from django.core.exceptions import ImproperlyConfigured

    from workers.metrics import MULTIPROC_ENV, serve_metrics

    settings.FEDINFER_WORKER_METRICS_PORT = free_port()
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    with pytest.raises(ImproperlyConfigured, match="`fedinfer worker`"):
        serve_metrics()
