"""An instance becoming ready and its region being evacuated, at the same time, on PostgreSQL.

Two threads (two connections) race a transition to ready against ``region_evacuate``; a pause
injected into one service holds it mid-transaction so the other runs inside that window, in
both orders. Whatever the order, no instance is left ready in an evacuated region: either the
evacuation drains it, or the transition is refused with 409.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection

from federation.core.errors import Conflict
from federation.inventory import lifecycle
from federation.inventory import services as inventory
from federation.inventory.models import Instance, Region
from federation.inventory.services import instances, regions
from tests.integration.control_plane_support import own_redis
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)

pytestmark = pytest.mark.django_db(transaction=True)

#: How long the paused service holds its transaction open; the other starts after LEAD.
PAUSE_S = 0.8
LEAD_S = 0.2


@pytest.fixture(autouse=True)
def _own_redis(settings: Any) -> Iterator[None]:
    """The recompiles the committed changes queue land in our own Redis DB, flushed."""
    with own_redis(settings, settings.REDIS_URL):
        yield


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` on its own thread (so its own database connection); its result or error
    lands in the returned dict."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # reported by the test
            outcome["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def warming_instance() -> Instance:
    region = make_region("eu-west", "EU")
    dep = make_deployment(make_model(), make_pool(region), tp=1, max_replicas=2)
    make_instance(dep, "eu-west-serving", "ready")
    return make_instance(dep, "eu-west-new", "warming")


def assert_no_ready_instance_in_an_evacuated_region() -> None:
    bad = Instance.objects.filter(
        state=lifecycle.READY, deployment__pool__region__status=Region.Status.EVACUATED
    )
    assert not bad.exists(), list(bad.values_list("name", flat=True))


def test_evacuation_during_a_transition_to_ready_drains_the_instance(monkeypatch) -> None:
    instance = warming_instance()
    write = instances.locked_instance_transition

    def slow_ready(**kwargs: Any) -> Instance:
        if kwargs["state"] == lifecycle.READY:
            time.sleep(PAUSE_S)  # checked, not yet written: the window an evacuation hits
        return write(**kwargs)

    monkeypatch.setattr(instances, "locked_instance_transition", slow_ready)
    ready, ready_outcome = in_thread(
        lambda: inventory.instance_transition(actor=None, instance=instance, state="ready")
    )
    time.sleep(LEAD_S)
    region = Region.objects.get(code="eu-west")
    evacuate, evacuate_outcome = in_thread(
        lambda: inventory.region_evacuate(actor=None, region=region)
    )
    for thread in (ready, evacuate):
        thread.join(timeout=30)
    assert "error" not in ready_outcome and "error" not in evacuate_outcome
    assert_no_ready_instance_in_an_evacuated_region()
    instance.refresh_from_db()
    # The evacuation waited for the transition to commit, then drained the new instance.
    assert (instance.state, instance.drain_reason) == ("draining", "evacuation")


def test_a_transition_to_ready_during_an_evacuation_is_refused(monkeypatch) -> None:
    instance = warming_instance()
    record = regions.audit_record

    def slow_evacuation_record(**kwargs: Any) -> Any:
        if kwargs["action"] == "region.evacuate":
            time.sleep(PAUSE_S)  # evacuated and drained, not yet committed
        return record(**kwargs)

    monkeypatch.setattr(regions, "audit_record", slow_evacuation_record)
    region = Region.objects.get(code="eu-west")
    evacuate, evacuate_outcome = in_thread(
        lambda: inventory.region_evacuate(actor=None, region=region)
    )
    time.sleep(LEAD_S)
    ready, ready_outcome = in_thread(
        lambda: inventory.instance_transition(actor=None, instance=instance, state="ready")
    )
    for thread in (ready, evacuate):
        thread.join(timeout=30)
    assert "error" not in evacuate_outcome
    assert_no_ready_instance_in_an_evacuated_region()
    error = ready_outcome.get("error")
    assert isinstance(error, Conflict) and error.code == "region_evacuated", ready_outcome
    assert "eu-west is evacuated" in str(error)
    instance.refresh_from_db()
    assert instance.state == "warming"


def test_undrain_races_evacuation_the_same_way(monkeypatch) -> None:
    instance = warming_instance()
    instance = inventory.instance_transition(actor=None, instance=instance, state="ready")
    instance = inventory.instance_drain(actor=None, instance=instance)
    write = instances.locked_instance_transition

    def slow_ready(**kwargs: Any) -> Instance:
        if kwargs["state"] == lifecycle.READY:
            time.sleep(PAUSE_S)
        return write(**kwargs)

    monkeypatch.setattr(instances, "locked_instance_transition", slow_ready)
    undrain, undrain_outcome = in_thread(
        lambda: inventory.instance_undrain(actor=None, instance=instance)
    )
    time.sleep(LEAD_S)
    region = Region.objects.get(code="eu-west")
    evacuate, evacuate_outcome = in_thread(
        lambda: inventory.region_evacuate(actor=None, region=region)
    )
    for thread in (undrain, evacuate):
        thread.join(timeout=30)
    assert "error" not in undrain_outcome and "error" not in evacuate_outcome
    assert_no_ready_instance_in_an_evacuated_region()


def test_the_api_answers_409_in_an_evacuated_region(admin_client) -> None:
    instance = warming_instance()
    assert admin_client.post("/api/v1/regions/eu-west/evacuate/").status_code == 200
    r = admin_client.post(
        f"/api/v1/instances/{instance.pk}/transition/", {"state": "ready"}, format="json"
    )
    assert r.status_code == 409, r.content
    assert r.json()["code"] == "region_evacuated"
    assert "restore the region first" in r.json()["detail"]
