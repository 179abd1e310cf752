"""The audit trail, read-only: who changed what, when."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import viewsets

from federation.core.api.filters import AuditEventFilter
from federation.core.api.serializers import AuditEventOutput
from federation.core.models import AuditEvent
from federation.core.selectors import audit_event_list

_DENIED = {
    401: OpenApiResponse(description="Not authenticated."),
    403: OpenApiResponse(description="Only admins and operators read the audit trail."),
}


@extend_schema_view(
    list=extend_schema(
        responses={
            200: AuditEventOutput,
            400: OpenApiResponse(description="Invalid filter."),
            **_DENIED,
        }
    ),
    retrieve=extend_schema(
        responses={
            200: AuditEventOutput,
            404: OpenApiResponse(description="No such event."),
            **_DENIED,
        }
    ),
)
class AuditEventViewSet(viewsets.ReadOnlyModelViewSet):
    """Audit events of every change, newest first (admins and operators)."""

    serializer_class = AuditEventOutput
    filterset_class = AuditEventFilter
    ordering_fields = ["created_at", "id"]

    def get_queryset(self) -> QuerySet[AuditEvent]:
        return audit_event_list(user=self.request.user)
