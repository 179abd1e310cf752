"""The Celery side of distribution: the debounced recompile after commit, and a real
``fedinfer worker`` (with embedded beat) on the Redis broker publishing new versions."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from rest_framework.test import APIClient

from federation.inventory.models import Instance, Region
from federation.routing import services
from federation.routing.models import RoutingTableVersion
from federation.telemetry import heartbeats
from regions.supervisor import Supervisor
from tests.integration.control_plane_support import FEDINFER, subprocess_env
from tests.integration.test_routing_distribution import (  # noqa: F401  (fixture)
    REDIS_TEST_URL,
    build_fleet,
    test_redis,
)
from workers.tasks import routing_tables_publish_task


def queued(client: redis.Redis) -> list[dict[str, Any]]:
    """Messages waiting on the default Celery queue."""
    return [json.loads(raw) for raw in client.lrange("celery", 0, -1)]


@pytest.mark.django_db
def test_a_burst_of_changes_queues_one_delayed_recompile(
    test_redis: redis.Redis,  # noqa: F811
    admin_client: APIClient,
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        fleet = build_fleet(admin_client)
    with django_capture_on_commit_callbacks(execute=True):
        for code in ("ap-1", "ap-2", "ap-3"):
            admin_client.post(
                "/api/v1/regions/",
                {
                    "code": code,
                    "name": code,
                    "provider": "cloud",
                    "latitude": 1.0,
                    "longitude": 2.0,
                    "jurisdiction": "IN",
                },
                format="json",
            )
        admin_client.post(f"/api/v1/regions/{fleet.eu.code}/evacuate/")
    (message,) = queued(test_redis)
    assert message["headers"]["task"] == "fedinfer.routing_tables.publish"
    assert message["headers"]["eta"] is not None  # the countdown lets the burst settle
    assert test_redis.exists(services.RECOMPILE_PENDING_KEY)

    # The task clears the mark first: a change committed from then on queues a new one.
    result = routing_tables_publish_task.apply()
    assert sorted(result.get()) == ["ap-1@1", "ap-2@1", "ap-3@1", "eu-west@1", "us-east@1"]
    assert not test_redis.exists(services.RECOMPILE_PENDING_KEY)
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(f"/api/v1/regions/{fleet.eu.code}/restore/")
    assert len(queued(test_redis)) == 2


@pytest.mark.django_db
def test_without_redis_a_queued_publish_an_earlier_started_one_covered_is_skipped(
    settings: Any,
    admin_client: APIClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The embedded demo: no Redis to debounce, so every change queues a publish of its own.
    settings.REDIS_URL = ""
    monkeypatch.setattr(services, "_last_full_publish", services._LastFullPublish())
    fleet = build_fleet(admin_client)
    due = time.time()
    assert [v.version for v in services.routing_tables_recompile(due_at=due)] == [1, 1]

    def drain(region: Region) -> None:  # a change every table of that region shows
        Instance.objects.filter(deployment__pool__region=region).update(state="draining")

    # Queued (due) before that publish started: that publish read its change. Skipped.
    drain(fleet.eu)
    assert services.routing_tables_recompile(due_at=due) == []
    # One region's publish is never skipped, nor the periodic one (no due time).
    (eu,) = services.routing_tables_recompile(regions=["eu-west"], due_at=due)
    assert (eu.region.code, eu.version) == ("eu-west", 2)
    drain(fleet.us)
    published = services.routing_tables_recompile()
    assert {(v.region.code, v.version) for v in published} == {("eu-west", 3), ("us-east", 2)}
    assert services._last_full_publish.started_at > due
    # A publish that fails does not count as started: its retry is not skipped.
    started = services._last_full_publish.started_at
    monkeypatch.setattr(services, "routing_tables_publish", _fails)
    with pytest.raises(RuntimeError):
        services.routing_tables_recompile(due_at=time.time())
    assert services._last_full_publish.started_at == started


def _fails(**_: Any) -> list[RoutingTableVersion]:
    raise RuntimeError("database gone")


@pytest.mark.django_db
def test_heartbeats_and_credential_rotation_queue_no_recompile(
    test_redis: redis.Redis,  # noqa: F811
    admin_client: APIClient,
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    fleet = build_fleet(admin_client)
    services.routing_tables_publish()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        services.edge_credential_rotate(actor=None, edge=fleet.eu_edge)
        heartbeats.edge_heartbeat_record(
            edge=fleet.eu_edge,
            applied_table_version=1,
            instances=[heartbeats.InstanceReport(id="eu-west-0", healthy=True, load={})],
        )
    assert callbacks == [] and queued(test_redis) == []


@pytest.fixture
def worker(transactional_db: None, procs: Supervisor) -> Path:
    """``fedinfer worker`` on Redis DB 14 and this test's database; beat every 2 s. Its log."""
    env = {**subprocess_env(REDIS_TEST_URL), "FEDINFER_TABLES_REFRESH_SECONDS": "2"}
    worker_argv = [FEDINFER, "worker", "--pool", "solo", "--without-gossip", "--without-mingle"]
    return procs.start("worker", worker_argv, env=env).log


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str, log: Path) -> float:
    """Seconds until ``predicate()`` holds; fails with the worker's log after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what} within {timeout} s; worker log:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)
    return time.monotonic() - started


def latest_document(code: str) -> dict[str, Any] | None:
    table = RoutingTableVersion.objects.filter(region__code=code).order_by("-version").first()
    return None if table is None else table.document


@pytest.mark.django_db(transaction=True)
def test_the_worker_publishes_after_an_evacuation_and_periodically(
    worker: Path,
    admin_client: APIClient,
    test_redis: redis.Redis,  # noqa: F811
) -> None:
    fleet = build_fleet(admin_client)  # its commits queue a recompile for the worker
    wait_for(
        lambda: latest_document("eu-west") is not None,
        timeout=30,
        what="the worker did not publish the first tables",
        log=worker,
    )
    first = latest_document("eu-west")
    assert first is not None and [i["id"] for i in first["instances"]] == ["eu-west-0"]

    r = admin_client.post(f"/api/v1/regions/{fleet.eu.code}/evacuate/")
    assert r.status_code == 200
    elapsed = wait_for(
        lambda: (latest_document("eu-west") or {}).get("instances") == [],
        timeout=10,
        what="no table without eu-west's instances",
        log=worker,
    )
    print(f"evacuation -> new eu-west version published by the worker: {elapsed * 1000:.0f} ms")
    assert elapsed < 5
    doc = latest_document("eu-west")
    assert doc is not None and doc["version"] > first["version"]

    # A change no service announces (no audit event, no task queued) still reaches the
    # tables through beat's periodic recompile.
    assert queued(test_redis) == []
    Region.objects.filter(pk=fleet.us.pk).update(status="evacuated")
    Instance.objects.filter(name="us-east-0").update(state="draining")
    wait_for(
        lambda: (latest_document("us-east") or {}).get("instances") == [],
        timeout=10,
        what="beat's periodic recompile did not publish us-east",
        log=worker,
    )


def test_embedded_mode_worker_uses_the_filesystem_broker_and_sqlite(
    tmp_path: Path, procs: Supervisor
) -> None:
    """``fedinfer demo``'s setting: no Redis, no PostgreSQL; a change made by one process is
    compiled by the worker through kombu's filesystem transport under ``var/broker/``."""
    env = {
        k: v
        for k, v in subprocess_env(REDIS_TEST_URL).items()
        if k not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"}
    }
    env["FEDINFER_VAR_DIR"] = str(tmp_path)
    env["FEDINFER_TABLES_REFRESH_SECONDS"] = "3600"  # the change's own task, not beat
    subprocess.run([FEDINFER, "migrate", "-v0"], env=env, check=True, timeout=120)
    log_path = procs.start("worker", [FEDINFER, "worker", "--pool", "solo"], env=env).log
    code = (
        "import django; django.setup()\n"
        "from federation.inventory import services\n"
        "services.region_create(actor=None, code='eu-west', name='EU', "
        "provider='cloud', latitude=1, longitude=1, jurisdiction='EU')\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    db = sqlite3.connect(tmp_path / "fedinfer.sqlite3")

    def published() -> bool:
        row = db.execute("SELECT count(*) FROM routing_routingtableversion").fetchone()
        return bool(row[0])

    wait_for(published, timeout=30, what="no table published", log=log_path)
    db.close()
