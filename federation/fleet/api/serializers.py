"""Input shapes of the placement API: strict (unknown fields refused, numbers as numbers) and
bounded (a plan request names at most ``MAX_DEMAND_ROWS`` demands)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from federation.api.serializers import InputSerializer
from federation.inventory.models import Region

MAX_DEMAND_ROWS = 10_000
#: A million tokens per second is far beyond any single model's traffic in a region.
MAX_TOKENS_PER_S = 1e9


class DemandInput(InputSerializer):
    model = serializers.CharField(max_length=128)
    region = serializers.CharField(max_length=63)
    tokens_per_s = serializers.FloatField(min_value=0, max_value=MAX_TOKENS_PER_S)
    tenant = serializers.CharField(
        max_length=63,
        required=False,
        default="",
        allow_blank=True,
        help_text="Whose demand it is (its residency decides where it may go); empty: only "
        "the region itself may serve it.",
    )


class PlanInput(InputSerializer):
    demand: serializers.ListSerializer[dict[str, Any]] = serializers.ListSerializer(
        child=DemandInput(),
        required=False,
        max_length=MAX_DEMAND_ROWS,
        help_text="Plan for this demand instead of the measured one (usage of the last "
        "window_hours, else the edges' heartbeats).",
    )
    window_hours = serializers.IntegerField(min_value=1, max_value=168, default=3)

    def validate_demand(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Demand comes from a region that exists: the planner has no residency class for
        any other (the API fuzzer's 500)."""
        named = {row["region"] for row in rows}
        unknown = sorted(
            named - set(Region.objects.filter(code__in=named).values_list("code", flat=True))
        )
        if unknown:
            raise serializers.ValidationError(f"No such region: {', '.join(unknown[:5])}.")
        return rows


class ApplyInput(PlanInput):
    plan = serializers.IntegerField(
        min_value=1,
        required=False,
        help_text="Id of a plan to apply; without it a plan is computed and applied at once.",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "plan" in attrs and ("demand" in attrs or "window_hours" in self.initial_data):
            raise serializers.ValidationError(
                {"plan": ["Give either a plan id or what to plan for, not both."]}
            )
        return attrs


class PlanOutput(serializers.Serializer):
    id = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    created_by = serializers.CharField()
    applied_at = serializers.DateTimeField(allow_null=True)
    applied_by = serializers.CharField()
    document = serializers.JSONField(
        help_text="changes (create, resize, remove, in the order applied), placements, "
        "unserved demand with its reason, cost before and after, solver status."
    )
