"""Output shapes of the distribution API (a heartbeat's are ``federation.telemetry``'s)."""

from __future__ import annotations

from django.utils import timezone
from rest_framework import serializers

from federation.api.serializers import OutputModelSerializer
from federation.inventory.models import Edge, Region


class EdgeCredentialOutput(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    region = serializers.CharField()
    credential = serializers.CharField(
        help_text="Shown this once; send it as 'Authorization: Bearer <credential>'."
    )


class EdgeVersionOutput(OutputModelSerializer):
    heartbeat_age_s = serializers.SerializerMethodField(
        help_text="Seconds since the last heartbeat (null: never)."
    )

    class Meta:
        model = Edge
        fields = ("id", "name", "applied_table_version", "last_heartbeat_at", "heartbeat_age_s")

    def get_heartbeat_age_s(self, edge: Edge) -> float | None:
        if edge.last_heartbeat_at is None:
            return None
        return round((timezone.now() - edge.last_heartbeat_at).total_seconds(), 3)


class RegionTableOutput(OutputModelSerializer):
    region = serializers.CharField(source="code", read_only=True)
    latest_version = serializers.IntegerField(read_only=True, allow_null=True)
    created_at = serializers.DateTimeField(
        source="latest_created_at", read_only=True, allow_null=True
    )
    edges = EdgeVersionOutput(many=True, read_only=True)

    class Meta:
        model = Region
        fields = ("region", "status", "latest_version", "created_at", "edges")
