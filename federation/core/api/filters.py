"""Filters for the audit trail."""

from __future__ import annotations

import django_filters

from federation.api.filters import StrictFilterSet, UTCIsoDateTimeFilter
from federation.core.models import AuditEvent


class AuditEventFilter(StrictFilterSet):
    object_type = django_filters.CharFilter(label="App label and model, e.g. 'tenancy.tenant'.")
    object_id = django_filters.CharFilter()
    actor = django_filters.CharFilter(field_name="actor_repr", label="Username, or 'system'.")
    action = django_filters.CharFilter(label="e.g. 'tenant.create', 'api_key.rotate'.")
    created_after = UTCIsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = UTCIsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = AuditEvent
        fields = ["object_type", "object_id", "actor", "action", "created_after", "created_before"]
