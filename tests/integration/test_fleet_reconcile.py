"""One reconcile pass at a time, in this process, against real PostgreSQL and real
``fedinfer engine-sim`` processes started by the local provisioner: the lifecycle, replica
counts, failure and replacement, and the crash windows (adoption, orphans)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.fleet import services as fleet
from federation.fleet.policy import FailoverPolicy, HealthPolicy, Timeouts
from federation.fleet.spec import EngineSpec, Running
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Instance
from federation.routing import services as routing
from federation.telemetry import heartbeats
from tests.integration.fleet_support import engines, kill_engine, ps_engines  # noqa: F401
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
CONFIG = fleet.FleetConfig(
    timeouts=Timeouts(loading_s=30, warming_s=30, drain_s=2),
    health=HealthPolicy(fail_after=2, recover_after=2),
    failover=FailoverPolicy(),
    probe_timeout_s=2,
)


@pytest.fixture
def deployment(db: None) -> Deployment:
    pool = make_pool(make_region("eu-west", "EU"), provisioner="local")
    return make_deployment(make_model(), pool, max_replicas=3)


def states(deployment: Deployment) -> dict[str, str]:
    return dict(deployment.instances.values_list("name", "state"))


def live(deployment: Deployment) -> set[str]:
    return {n for n, s in states(deployment).items() if s not in ("failed", "stopped")}


def reconcile_until(
    provisioner: LocalProvisioner, done: Callable[[], bool], what: str, timeout: float = 30
) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        fleet.fleet_reconcile(provisioners={"local": provisioner}, config=CONFIG)
        time.sleep(0.2)


def ready(deployment: Deployment, count: int) -> Callable[[], bool]:
    def check() -> bool:
        s = states(deployment)
        return sum(v == "ready" for v in s.values()) == count and len(live(deployment)) == count

    return check


def test_instances_are_started_walked_to_ready_replaced_and_scaled_down(
    deployment: Deployment,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    reconcile_until(engines, ready(deployment, 1), "one ready instance")
    (first,) = live(deployment)
    assert set(engines.running()) == {first} and len(ps_engines(engines)) == 1
    transitions = [
        e.changes["state"]
        for e in AuditEvent.objects.filter(
            action="instance.transition", object_repr=first
        ).order_by("pk")
    ]
    assert transitions == [["pending", "loading"], ["loading", "warming"], ["warming", "ready"]]

    # An engine killed behind the worker's back: failed at once, and replaced in its pool.
    kill_engine(engines, first)
    fleet.fleet_reconcile(provisioners={"local": engines}, config=CONFIG)
    assert states(deployment)[first] == "failed"
    fail = AuditEvent.objects.get(
        action="instance.transition", object_repr=first, changes__state=["ready", "failed"]
    )
    assert "gone" in fail.changes["reason"]
    reconcile_until(engines, ready(deployment, 1), "a replacement")
    (second,) = live(deployment)
    assert second != first and set(engines.running()) == {second}

    # desired_replicas is acted on both ways.
    inventory.deployment_update(actor=None, deployment=deployment, data={"desired_replicas": 3})
    reconcile_until(engines, ready(deployment, 3), "three ready instances")
    assert set(engines.running()) == live(deployment) and len(ps_engines(engines)) == 3
    inventory.deployment_update(
        actor=None, deployment=deployment, data={"min_replicas": 0, "desired_replicas": 1}
    )
    fleet.fleet_reconcile(provisioners={"local": engines}, config=CONFIG)
    draining = {n for n, s in states(deployment).items() if s == "draining"}
    assert len(draining) == 2
    assert set(
        Instance.objects.filter(name__in=draining).values_list("drain_reason", flat=True)
    ) == {"scale_down"}
    reconcile_until(engines, ready(deployment, 1), "scaled down to one (drain timeout 2 s)")
    assert all(states(deployment)[n] == "stopped" for n in draining)
    assert set(engines.running()) == live(deployment) and len(ps_engines(engines)) == 1


class CrashAfterStart:
    """The local provisioner, but the worker 'dies' right after an engine is spawned, before
    anything about it is recorded."""

    def __init__(self, inner: LocalProvisioner) -> None:
        self.inner = inner
        self.kind = inner.kind

    def endpoint_for(self, name: str) -> str:
        return self.inner.endpoint_for(name)

    def start(self, spec: EngineSpec) -> Running:
        self.inner.start(spec)
        raise SystemExit("worker killed")

    def stop(self, name: str) -> None:
        self.inner.stop(name)

    def is_running(self, name: str) -> bool:
        return self.inner.is_running(name)

    def running(self) -> dict[str, Running]:
        return self.inner.running()


def test_an_engine_started_just_before_a_crash_is_adopted_not_started_twice(
    deployment: Deployment,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    with pytest.raises(SystemExit):
        fleet.fleet_reconcile(provisioners={"local": CrashAfterStart(engines)}, config=CONFIG)
    (name,) = live(deployment)
    assert states(deployment)[name] == "pending" and set(engines.running()) == {name}
    pids = ps_engines(engines)
    reconcile_until(engines, ready(deployment, 1), "the adopted engine ready")
    assert live(deployment) == {name} and ps_engines(engines) == pids


def test_an_engine_no_instance_names_is_stopped_and_a_terminal_ones_engine_too(
    deployment: Deployment,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    url = engines.endpoint_for("stray")
    engines.start(EngineSpec(name="stray", url=url, model="m", served_model_name="m"))
    reconcile_until(engines, ready(deployment, 1), "one ready instance")
    assert "stray" not in engines.running()
    (name,) = live(deployment)
    # Marked failed but its engine left running (a crash between the two halves of a stop).
    inventory.instance_transition(
        actor=None, instance=Instance.objects.get(name=name), state="failed"
    )
    assert name in engines.running()
    reconcile_until(engines, ready(deployment, 1), "a replacement")
    assert name not in engines.running() and len(ps_engines(engines)) == 1


def test_a_ready_engine_that_stops_answering_fails_only_after_the_hysteresis(
    deployment: Deployment,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    reconcile_until(engines, ready(deployment, 1), "one ready instance")
    (name,) = live(deployment)
    pid = int(engines.running()[name].detail["pid"])
    os.killpg(pid, signal.SIGSTOP)  # hangs: the process is there, it does not answer
    try:
        fleet.fleet_reconcile(provisioners={"local": engines}, config=CONFIG)
        assert states(deployment)[name] == "ready"  # one failed probe is a flap
        fleet.fleet_reconcile(provisioners={"local": engines}, config=CONFIG)
        assert states(deployment)[name] == "failed"
    finally:
        with contextlib.suppress(ProcessLookupError):  # stopped by the fleet, as it should be
            os.killpg(pid, signal.SIGCONT)
    assert name not in engines.running()


def test_a_pools_provisioner_is_chosen_through_the_api(admin_client: APIClient) -> None:
    make_region("eu-west", "EU")
    body = {
        "region": "eu-west",
        "name": "l4",
        "accelerator": "L4-24G",
        "gpus_per_node": 4,
        "node_count": 1,
        "interconnect": "pcie",
        "price_per_gpu_hour": "0.50",
        "capacity_type": "on_demand",
    }
    r = admin_client.post("/api/v1/pools/", {**body, "provisioner": "cloud-magic"}, format="json")
    assert r.status_code == 400 and "provisioner" in r.json(), r.json()
    r = admin_client.post("/api/v1/pools/", {**body, "provisioner": "local"}, format="json")
    assert r.status_code == 201 and r.json()["provisioner"] == "local"
    r = admin_client.post("/api/v1/pools/", {**body, "name": "l4-b"}, format="json")
    assert r.json()["provisioner"] == "static"  # today's behaviour unless asked


@pytest.mark.slow
def test_a_scale_down_waits_for_the_edges_tables_and_the_engines_own_work(
    deployment: Deployment,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    patient = replace(CONFIG, timeouts=Timeouts(loading_s=30, warming_s=30, drain_s=300))

    def reconcile() -> None:
        fleet.fleet_reconcile(provisioners={"local": engines}, config=patient)

    inventory.deployment_update(actor=None, deployment=deployment, data={"desired_replicas": 2})
    reconcile_until(engines, ready(deployment, 2), "two ready instances")
    newest = deployment.instances.order_by("-created_at").first()
    assert newest is not None
    edge = inventory.edge_register(
        actor=None, region=deployment.pool.region, name="edge-1", url="http://127.0.0.1:9"
    )
    (v1,) = routing.routing_tables_publish()
    heartbeats.edge_heartbeat_record(edge=edge, applied_table_version=v1.version, instances=[])

    # A long answer in flight on the replica the scale-down will pick (newest, equally idle).
    answer: dict[str, Any] = {}

    def ask() -> None:
        r = httpx.post(
            newest.endpoint_url + "/v1/completions",
            json={"model": LLAMA, "prompt": "hi", "max_tokens": 3000, "min_tokens": 3000},
            timeout=120,
        )
        answer.update(status=r.status_code, body=r.json())

    asking = threading.Thread(target=ask)
    asking.start()
    try:
        time.sleep(0.5)
        inventory.deployment_update(
            actor=None, deployment=deployment, data={"min_replicas": 0, "desired_replicas": 1}
        )
        reconcile()
        assert states(deployment)[newest.name] == "draining"
        reconcile()  # no table without it yet: an edge may still send it requests
        assert states(deployment)[newest.name] == "draining"
        (v2,) = routing.routing_tables_publish()
        reconcile()  # published, but the edge still applies the older table
        assert states(deployment)[newest.name] == "draining"
        heartbeats.edge_heartbeat_record(edge=edge, applied_table_version=v2.version, instances=[])
        assert asking.is_alive(), "the answer finished too soon to show the drain waiting"
        reconcile()  # every edge knows, but the engine still runs the answer
        assert states(deployment)[newest.name] == "draining"
    finally:
        asking.join(120)
    reconcile()
    assert states(deployment)[newest.name] == "stopped"
    assert answer["status"] == 200 and answer["body"]["usage"]["completion_tokens"] == 3000
    assert newest.name not in engines.running()


def test_what_the_worker_remembers_is_browsable_read_only_in_the_admin(
    deployment: Deployment,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    reconcile_until(engines, ready(deployment, 1), "one ready instance")
    (name,) = live(deployment)
    staff = User.objects.create_superuser("root", password="pw-root-1234")
    client = Client()
    client.force_login(staff)
    page = client.get("/admin/fleet/instanceruntime/")
    assert page.status_code == 200 and name in page.content.decode()
    assert client.get("/admin/fleet/regionfailover/").status_code == 200
    assert client.get("/admin/fleet/instanceruntime/add/").status_code == 403


def test_fedinfer_engines_lists_the_engines_with_their_instances_and_stops_them(
    deployment: Deployment,
    engines: LocalProvisioner,  # noqa: F811
    settings: Any,
) -> None:
    settings.FEDINFER_LOCAL_ENGINES_DIR = engines.engines_dir
    reconcile_until(engines, ready(deployment, 1), "one ready instance")
    (name,) = live(deployment)
    stray = EngineSpec(
        name="stray", url=engines.endpoint_for("stray"), model="m", served_model_name="m"
    )
    engines.start(stray)
    out = io.StringIO()
    call_command("engines", stdout=out)
    lines = sorted(out.getvalue().splitlines())
    assert len(lines) == 2
    assert lines[0].startswith(name) and lines[0].endswith("\tready")
    assert lines[1].startswith("stray") and lines[1].endswith("no instance (orphan)")
    with pytest.raises(CommandError, match="No engine named nothing"):
        call_command("engines", "--stop", "nothing")
    call_command("engines", "--stop-all", stdout=io.StringIO())
    assert engines.running() == {} and ps_engines(engines) == []


def test_an_instance_the_operator_registered_on_a_provisioned_pool_is_left_alone(
    deployment: Deployment,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    """It counts toward desired_replicas, is never probed, failed, stopped or drained: only
    what the worker created is the worker's."""
    hand = make_instance(deployment, "by-hand", "ready", endpoint_url="http://10.9.9.9:8000")
    for _ in range(3):
        fleet.fleet_reconcile(provisioners={"local": engines}, config=CONFIG)
    assert states(deployment) == {"by-hand": "ready"} and engines.running() == {}
    inventory.deployment_update(actor=None, deployment=deployment, data={"desired_replicas": 2})
    reconcile_until(engines, ready(deployment, 2), "the worker's own second replica")
    (ours,) = set(engines.running())
    inventory.deployment_update(
        actor=None, deployment=deployment, data={"min_replicas": 0, "desired_replicas": 1}
    )
    reconcile_until(engines, lambda: states(deployment)[ours] == "stopped", "ours scaled down")
    assert states(deployment)[hand.name] == "ready"
