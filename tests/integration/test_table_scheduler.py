"""A recorded change reaches the routing tables through one explicit call: ``audit_record``
hands its event to the one scheduler routing set at start-up (``federation.core.changes``),
not through a signal receiver."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db.models.signals import post_save

from federation.core import changes
from federation.core.audit import audit_record
from federation.core.models import AuditEvent
from federation.routing import services
from federation.tenancy.models import Tenant
from tests.integration.inventory_factories import make_region

pytestmark = pytest.mark.django_db


def test_routing_sets_the_one_scheduler_and_no_signal_receiver_is_left() -> None:
    assert changes.table_scheduler() is services.TABLE_SCHEDULER
    assert not post_save.has_listeners(AuditEvent)


def test_audit_record_hands_each_event_to_the_scheduler_set() -> None:
    region = make_region()
    seen: list[AuditEvent] = []
    stand_in = changes.TableScheduler(
        change_recorded=seen.append, budget_spend_counted=lambda: True
    )
    previous = changes.table_scheduler_set(stand_in)
    try:
        event = audit_record(actor=None, action="region.update", obj=region)
        assert changes.budget_spend_counted() is True
        assert changes.table_scheduler_set(None) is stand_in  # one slot: replaced, not added
        audit_record(actor=None, action="region.update", obj=region)  # no scheduler: nothing
        assert changes.budget_spend_counted() is False
    finally:
        changes.table_scheduler_set(previous)
    assert seen == [event]


def test_what_a_recorded_change_schedules_after_commit(
    django_capture_on_commit_callbacks: Callable[..., Any], make_tenant: Callable[..., Tenant]
) -> None:
    region = make_region()
    tenant = make_tenant("acme")
    with django_capture_on_commit_callbacks() as callbacks:
        audit_record(actor=None, action="region.update", obj=region)
    assert callbacks == [services.routing_tables_schedule_recompile]
    with django_capture_on_commit_callbacks() as callbacks:
        audit_record(actor=None, action="tenant.deactivate", obj=tenant)
    assert callbacks == [services.routing_tables_publish_now]
    with django_capture_on_commit_callbacks() as callbacks:
        audit_record(actor=None, action="edge.rotate_credential", obj=region)
        audit_record(actor=None, action="fleet.note", obj=AuditEvent.objects.first())
    assert callbacks == []
