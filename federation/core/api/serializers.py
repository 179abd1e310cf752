from __future__ import annotations

from rest_framework import serializers

from federation.api.serializers import OutputModelSerializer
from federation.core.models import AuditEvent


class AuditEventOutput(OutputModelSerializer):
    actor = serializers.CharField(source="actor_repr", help_text="Username, or 'system'.")

    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "created_at",
            "actor",
            "action",
            "object_type",
            "object_id",
            "object_repr",
            "changes",
        ]
