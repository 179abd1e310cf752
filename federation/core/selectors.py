"""Reads of cross-cutting records."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from federation.core.models import AuditEvent
from federation.core.roles import is_staff_role


def audit_event_list(*, user: Any) -> QuerySet[AuditEvent]:
    """The audit trail spans every tenant, so only admins and operators read it."""
    if not is_staff_role(user):
        return AuditEvent.objects.none()
    return AuditEvent.objects.all()
