"""The audit trail, read-only: who changed what, when."""

from __future__ import annotations

from django.db.models import QuerySet
from rest_framework import viewsets

from federation.core.api.filters import AuditEventFilter
from federation.core.api.serializers import AuditEventOutput
from federation.core.models import AuditEvent
from federation.core.selectors import audit_event_list


class AuditEventViewSet(viewsets.ReadOnlyModelViewSet):
    """Audit events of every change, newest first (admins and operators)."""

    serializer_class = AuditEventOutput
    filterset_class = AuditEventFilter
    ordering_fields = ["created_at", "id"]
    lookup_value_regex = r"[0-9]+"

    def get_queryset(self) -> QuerySet[AuditEvent]:
        return audit_event_list(user=self.request.user)
