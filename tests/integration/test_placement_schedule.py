"""The placement planner on the worker's schedule, through the real Celery task on PostgreSQL:
mode ``plan`` keeps the dry run (listed by the API) and changes nothing in the fleet, mode
``apply`` applies a plan that changes something (audited), a plan whose fleet changed before
it could be applied stays a plan, and a second worker never plans while one holds the lock."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from django.db import connection
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.fleet import placement_inputs, placing
from federation.fleet.locks import LOCK_NAMESPACE, PLACEMENT_LOCK_ID
from federation.fleet.models import PlacementPlan
from federation.inventory import services as inventory
from federation.inventory.models import Deployment
from regions.supervisor import wait_until
from tests.integration.inventory_factories import make_instance
from tests.integration.test_placement_api import (  # noqa: F401  (fixture)
    ONE_REPLICA,
    fleet_rows,
    fleet_state,
    heartbeat,
)
from workers.tasks import fleet_placement_task

PLANS = "/api/v1/placement/plans/"


def scheduled_events() -> list[dict[str, Any]]:
    rows = AuditEvent.objects.filter(action="fleet.placement.scheduled").order_by("pk")
    return [row.changes for row in rows]


@pytest.fixture
def busy_eu(fleet_rows: dict[str, Any]) -> dict[str, Any]:  # noqa: F811
    """The edges report 2.5 replicas' worth of load on the one EU replica: the plan grows it."""
    heartbeat(make_instance(fleet_rows["dep"], "eu-1", "ready"), 2.5 * ONE_REPLICA)
    return fleet_rows


def test_mode_plan_keeps_the_plan_and_changes_nothing(
    busy_eu: dict[str, Any], settings: Any, operator_client: APIClient
) -> None:
    settings.FEDINFER_PLACEMENT_MODE = "plan"
    before = fleet_state()[0]
    done = fleet_placement_task.apply().get()
    plan = PlacementPlan.objects.get()
    assert done == f"plan {plan.pk}: 1 change(s), planned"
    assert plan.applied_at is None and plan.created_by == "system"
    assert fleet_state()[0] == before
    assert scheduled_events() == [
        {"mode": "plan", "outcome": "planned", "changes": 1, "cost": plan.document["cost"]}
    ]
    # The API lists it for an operator to read (and apply by id).
    listed = operator_client.get(PLANS).json()["results"]
    assert [(p["id"], p["applied_at"]) for p in listed] == [(plan.pk, None)]
    change = listed[0]["document"]["changes"][0]
    assert (change["pool"], change["action"], change["after"]) == ("eu-west/h100", "resize", 3)


def test_mode_apply_applies_a_plan_that_changes_something_once(
    busy_eu: dict[str, Any], settings: Any
) -> None:
    settings.FEDINFER_PLACEMENT_MODE = "apply"
    done = fleet_placement_task.apply().get()
    plan = PlacementPlan.objects.get()
    assert done == f"plan {plan.pk}: 1 change(s), applied"
    assert plan.applied_at is not None
    assert Deployment.objects.get(pk=busy_eu["dep"].pk).desired_replicas == 3
    assert AuditEvent.objects.filter(action="fleet.placement.apply").count() == 1
    # The next pass finds nothing to change: it keeps its plan and applies nothing.
    state = fleet_state()[0]
    done = fleet_placement_task.apply().get()
    assert done.endswith(": 0 change(s), planned"), done
    assert fleet_state()[0] == state
    assert [e["outcome"] for e in scheduled_events()] == ["applied", "planned"]
    assert AuditEvent.objects.filter(action="fleet.placement.apply").count() == 1


def test_a_fleet_changed_since_the_plan_is_left_alone(
    busy_eu: dict[str, Any], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator changes a deployment between the planner reading the fleet and applying its
    plan: the plan is refused, kept, and nothing the operator did is overwritten."""
    settings.FEDINFER_PLACEMENT_MODE = "apply"
    read_fleet = placement_inputs.placement_input

    def operator_moves_meanwhile(**kwargs: Any) -> Any:
        data = read_fleet(**kwargs)
        inventory.deployment_update(actor=None, deployment=busy_eu["dep"], data={"max_replicas": 5})
        return data

    monkeypatch.setattr(placement_inputs, "placement_input", operator_moves_meanwhile)
    done = fleet_placement_task.apply().get()
    assert done.endswith(": 1 change(s), not applied: the fleet changed since the plan"), done
    dep = Deployment.objects.get(pk=busy_eu["dep"].pk)
    assert (dep.desired_replicas, dep.max_replicas) == (1, 5)
    assert PlacementPlan.objects.get().applied_at is None
    assert not AuditEvent.objects.filter(action="fleet.placement.apply").exists()


def test_a_second_worker_does_not_plan_while_one_holds_the_lock(
    busy_eu: dict[str, Any], settings: Any
) -> None:
    settings.FEDINFER_PLACEMENT_MODE = "apply"
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as other:
        held = other.execute(
            "SELECT pg_try_advisory_lock(%s, %s)", [LOCK_NAMESPACE, PLACEMENT_LOCK_ID]
        ).fetchone()
        assert held == (True,) and not _placement_lock_free()
        assert fleet_placement_task.apply().get() == ""
        assert not PlacementPlan.objects.exists()
    # Released with the other worker's session, once its server process has ended (a client's
    # close does not wait for that: a pass right after it once still found the lock held).
    wait_until(_placement_lock_free, what="the closed session's advisory lock released")
    assert fleet_placement_task.apply().get().endswith(", applied")


def _placement_lock_free() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND classid = %s AND objid = %s",
            [LOCK_NAMESPACE, PLACEMENT_LOCK_ID],
        )
        return bool(cursor.fetchone()[0] == 0)


def test_the_schedule_keeps_its_newest_unapplied_plans_only(
    busy_eu: dict[str, Any], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.FEDINFER_PLACEMENT_MODE = "plan"
    monkeypatch.setattr(placing, "SCHEDULED_PLANS_KEPT", 2)
    passes = [fleet_placement_task.apply().get() for _ in range(4)]
    kept = list(PlacementPlan.objects.values_list("pk", flat=True))  # newest first
    assert len(kept) == 2 and all(f"plan {pk}:" in passes[-1 - i] for i, pk in enumerate(kept))
