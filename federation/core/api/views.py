"""The audit trail, read-only: who changed what, when."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view

from federation.api.schema import ErrorOutput
from federation.api.views import ReadViewSet
from federation.core.api.filters import AuditEventFilter
from federation.core.api.serializers import AuditEventOutput
from federation.core.models import AuditEvent
from federation.core.selectors import audit_event_list

_STAFF_ONLY = OpenApiResponse(
    ErrorOutput, description="Only admins and operators read the audit trail."
)


@extend_schema_view(
    list=extend_schema(responses={200: AuditEventOutput, 403: _STAFF_ONLY}),
    retrieve=extend_schema(responses={200: AuditEventOutput, 403: _STAFF_ONLY}),
)
class AuditEventViewSet(ReadViewSet):
    """Audit events of every change, newest first (admins and operators)."""

    queryset = AuditEvent.objects.none()
    output_serializer = AuditEventOutput
    filterset_class = AuditEventFilter
    ordering_fields = ["created_at", "id"]

    def get_queryset(self) -> QuerySet[AuditEvent]:
        return audit_event_list(user=self.request.user)
