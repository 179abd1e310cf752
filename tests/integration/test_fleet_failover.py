"""Automatic failover end to end on loopback, driven by a real ``fedinfer worker`` (Celery with
embedded beat, on this test's Redis DB and PostgreSQL database) whose local provisioner starts
``fedinfer engine-sim`` processes; ``fedinfer serve`` and ``fedinfer edge`` in control-plane mode.

* an engine killed → marked failed, out of every region's table, replaced, served again;
* a region whose edges all fall silent → evacuated with no operator call, restored (with the
  ramp) once its edges are back and stable;
* the worker killed mid-pass, again and again, then restarted, the database cutting the
  worker's connections mid-pass, and the worker's Redis (its broker) stopped and started again
  → no duplicate instances, no orphaned engines (the provisioner's listing and ``ps`` agree
  with the database).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection

from federation.core.models import AuditEvent
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Instance, Region
from federation.routing import services as routing
from federation.routing.models import RoutingTableVersion
from federation.tenancy import services as tenancy
from regions.supervisor import Process, Supervisor, free_port
from tests.integration.control_plane_support import (
    FEDINFER,
    serve,
    start_control_plane_edge,
    subprocess_env,
    write_table_keys,
)
from tests.integration.fleet_support import (  # noqa: F401
    REDIS_URL,
    engines,
    group_gone,
    kill_engine,
    live,
    ps_engines,
    ready,
    redis_of_this_test,
    wait_until,
)
from tests.integration.inventory_factories import (
    LLAMA_8B,
    make_deployment,
    make_model,
    make_pool,
    make_region,
)
from tests.integration.redis_support import PrivateRedis, private_redis  # noqa: F401
from workers.provisioners.local import LocalProvisioner

LLAMA = LLAMA_8B["name"]
SILENCE_S = 3
RESTORE_AFTER_S = 3


def env(engines_dir: Path, redis_url: str = REDIS_URL) -> dict[str, str]:
    return subprocess_env(
        redis_url,
        FEDINFER_LOCAL_ENGINES_DIR=str(engines_dir),
        FEDINFER_FLEET_INTERVAL_SECONDS="1",
        FEDINFER_FLEET_DRAIN_TIMEOUT_SECONDS="2",
        FEDINFER_FLEET_DRAIN_MIN_SECONDS="1",
        FEDINFER_FAILOVER_EDGE_SILENCE_SECONDS=str(SILENCE_S),
        FEDINFER_FAILOVER_RESTORE_AFTER_SECONDS=str(RESTORE_AFTER_S),
        FEDINFER_RAMP_SECONDS="6",
        FEDINFER_TABLES_REFRESH_SECONDS="60",  # failover must not need the periodic recompile
    )


def start_worker(procs: Supervisor, engines_dir: Path, redis_url: str = REDIS_URL) -> Process:
    argv = [FEDINFER, "worker", "--pool", "solo", "--without-gossip", "--without-mingle"]
    return procs.start("worker", argv, env=env(engines_dir, redis_url))


def latest_tables() -> dict[str, dict[str, Any]]:
    out = {}
    for code in Region.objects.values_list("code", flat=True):
        table = RoutingTableVersion.objects.filter(region__code=code).order_by("-version").first()
        if table is not None:
            out[code] = table.document
    return out


def in_any_table(name: str) -> bool:
    return any(
        name in {i["id"] for i in doc["instances"]} or name in str(doc.get("remote_regions"))
        for doc in latest_tables().values()
    )


@pytest.mark.django_db(transaction=True)
def test_an_engine_dies_and_a_region_falls_silent_and_the_fleet_heals_both(
    procs: Supervisor,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    eu = make_region("eu-west", "EU")
    us = make_region("us-east", "US")
    for src, dst in ((eu, us), (us, eu)):
        inventory.region_link_set(actor=None, source=src, target=dst, rtt_ms=20)
    model = make_model()
    dep = make_deployment(model, make_pool(eu, provisioner="local"), max_replicas=2)
    make_deployment(model, make_pool(us, provisioner="local"), max_replicas=2)
    edge_port, ops_port = free_port(), free_port()
    edge = inventory.edge_register(
        actor=None, region=eu, name="edge-eu-west", url=f"http://127.0.0.1:{edge_port}"
    )
    credential = routing.edge_credential_rotate(actor=None, edge=edge)
    tenant = tenancy.tenant_create(actor=None, slug="anyone", name="Anyone")
    key = tenancy.api_key_create(actor=None, tenant=tenant, name="k").plaintext
    routing.routing_tables_publish()

    worker = start_worker(procs, engines.engines_dir)
    log = worker.log
    cp, _ = serve(procs, env(engines.engines_dir))
    wait_until(lambda: len(ready(dep)) == 1, 60, "the worker brings eu-west's replica up", log)
    (first,) = ready(dep)
    wait_until(lambda: in_any_table(first), 10, "the ready instance in eu-west's table", log)
    edge_proc = start_control_plane_edge(
        procs,
        region="eu-west",
        control_plane=cp,
        credential=credential,
        table_keys=write_table_keys(procs.log_dir / "table-keys"),
        port=edge_port,
        ops_port=ops_port,
        env=env(engines.engines_dir),
    )

    def served_by() -> str | None:
        try:
            r = httpx.post(
                f"http://127.0.0.1:{edge_port}/v1/chat/completions",
                json={
                    "model": LLAMA,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
                headers={"Authorization": f"Bearer {key}"},
                timeout=10,
            )
        except httpx.TransportError:
            return None
        return r.headers.get("x-fedinfer-route", "") if r.status_code == 200 else None

    wait_until(lambda: first in (served_by() or ""), 20, "the edge serves from it", log)

    # 1. The engine dies: failed, out of every table, replaced — no operator call.
    killed_at = time.monotonic()
    kill_engine(engines, first)
    wait_until(lambda: Instance.objects.get(name=first).state == "failed", 10, "marked failed", log)
    out = wait_until(lambda: not in_any_table(first), 10, "out of every table", log)
    print(f"engine killed -> out of every table: {time.monotonic() - killed_at:.2f} s ({out:.2f})")
    assert time.monotonic() - killed_at < 5
    wait_until(lambda: len(ready(dep)) == 1, 30, "a replacement ready", log)
    (second,) = ready(dep)
    assert second != first and set(engines.running()) >= {second}
    assert first not in engines.running()
    wait_until(lambda: second in (served_by() or ""), 20, "served by the replacement", log)

    # 2. eu-west's only edge falls silent (hung): evacuated automatically, then restored.
    os.killpg(edge_proc.pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: Region.objects.get(pk=eu.pk).status == "evacuated",
            SILENCE_S + 10,
            "eu-west evacuated with no operator call",
            log,
        )
    finally:
        os.killpg(edge_proc.pid, signal.SIGCONT)
    event = AuditEvent.objects.get(action="fleet.region_evacuate", object_id=str(eu.pk))
    assert "silent" in event.changes["reason"] and event.actor_repr == "system"
    assert Instance.objects.get(name=second).drain_reason == "evacuation"
    wait_until(lambda: not in_any_table(second), 10, "eu-west's instance out of the tables", log)
    restored = wait_until(
        lambda: Region.objects.get(pk=eu.pk).status == "active",
        RESTORE_AFTER_S + 20,
        "eu-west restored once its edge is back and stable",
        log,
    )
    assert restored >= RESTORE_AFTER_S - 1
    eu.refresh_from_db()
    assert eu.restored_at is not None  # the compiler ramps its traffic back from here
    assert AuditEvent.objects.filter(action="fleet.region_restore", object_id=str(eu.pk)).exists()
    assert Instance.objects.get(name=second).state == "ready"
    wait_until(lambda: second in (served_by() or ""), 20, "served in eu-west again", log)
    assert set(engines.running()) == live(dep) | live(Deployment.objects.exclude(pk=dep.pk).get())


@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_mid_pass_leaves_no_duplicates_and_no_orphans(
    procs: Supervisor,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    region = make_region("eu-west", "EU")
    dep = make_deployment(
        make_model(),
        make_pool(region, provisioner="local"),
        min_replicas=0,
        desired_replicas=3,
        max_replicas=4,
    )
    log = procs.log_dir / "worker.log"
    for delay in (1.5, 0.7, 1.1, 0.4):
        worker = start_worker(procs, engines.engines_dir)
        time.sleep(delay)
        worker.send_signal(signal.SIGKILL)  # mid-pass, at whatever it was doing
        worker.wait(10)
        procs.processes.remove(worker)
        # Its embedded beat (a child process) goes with it, or it would queue the schedule
        # forever and the next worker's beat would double it.
        gone = functools.partial(group_gone, worker.pid)
        wait_until(gone, 10, "the killed worker's beat gone", log)
    start_worker(procs, engines.engines_dir)
    wait_until(lambda: len(ready(dep)) == 3, 60, "three ready instances", log)
    time.sleep(2)  # a few more passes: nothing more may start
    assert len(live(dep)) == 3
    assert set(engines.running()) == live(dep)
    assert len(ps_engines(engines)) == 3

    inventory.deployment_update(actor=None, deployment=dep, data={"desired_replicas": 0})
    wait_until(lambda: not live(dep), 30, "scaled to zero", log)
    wait_until(lambda: not ps_engines(engines), 15, "no engine process left", log)
    assert engines.running() == {}


@pytest.mark.django_db(transaction=True)
def test_the_database_cutting_the_workers_connections_mid_pass_leaves_no_duplicates(
    procs: Supervisor,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    """Every 0.2 s for 8 s PostgreSQL terminates the worker's connections to this database (as a
    failover of the database would): passes die between any two writes, tasks retry, the
    advisory locks go with the connections. Afterwards: exactly the desired engines."""
    region = make_region("eu-west", "EU")
    dep = make_deployment(
        make_model(),
        make_pool(region, provisioner="local"),
        min_replicas=0,
        desired_replicas=3,
        max_replicas=4,
    )
    worker = start_worker(procs, engines.engines_dir)
    others = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    with connection.cursor() as cursor:

        def connected() -> bool:
            cursor.execute(others)
            return bool(cursor.fetchone()[0])

        # The 8 s of cuts start once the worker is connected (it starts slowly on a busy machine).
        wait_until(connected, 60, "the worker connected to the database", worker.log)
        cut = 0
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            cut += cursor.fetchone()[0]
            time.sleep(0.2)
    # The worker was connected and cut off, again and again, and its tasks noticed.
    assert cut >= 2, cut
    assert "OperationalError" in worker.log.read_text()
    wait_until(lambda: len(ready(dep)) == 3, 60, "three ready instances", worker.log)
    time.sleep(2)
    assert len(live(dep)) == 3
    assert set(engines.running()) == live(dep)
    assert len(ps_engines(engines)) == 3
    assert worker.poll() is None  # the worker itself survived its database going away


@pytest.mark.django_db(transaction=True)
def test_redis_restarted_mid_run_leaves_no_duplicates_and_the_worker_acts_again(
    procs: Supervisor,
    engines: LocalProvisioner,  # noqa: F811
    private_redis: PrivateRedis,  # noqa: F811
) -> None:
    """The worker's broker (its own Redis here) stops for a few seconds and comes back: the
    beat and the worker reconnect on their own, the passes resume — a replica asked for after
    is started once — and nothing is started twice or left behind. (Celery 5.7.0's worker died
    here: pyproject.toml excludes it.)"""
    region = make_region("eu-west", "EU")
    dep = make_deployment(
        make_model(),
        make_pool(region, provisioner="local"),
        min_replicas=0,
        desired_replicas=2,
        max_replicas=4,
    )
    worker = start_worker(procs, engines.engines_dir, private_redis.url)
    wait_until(lambda: len(ready(dep)) == 2, 60, "two ready instances", worker.log)

    private_redis.stop()
    time.sleep(4)  # passes due meanwhile cannot be queued
    private_redis.start()
    inventory.deployment_update(actor=None, deployment=dep, data={"desired_replicas": 3})

    wait_until(lambda: len(ready(dep)) == 3, 60, "the third replica ready after Redis", worker.log)
    assert "Connection to broker lost" in worker.log.read_text()
    time.sleep(2)  # a few more passes: nothing more may start
    assert len(live(dep)) == 3
    assert set(engines.running()) == live(dep)
    assert len(ps_engines(engines)) == 3
    assert worker.poll() is None  # the worker itself survived its broker going away
