"""Input and output shapes of an edge's heartbeat (``POST /api/v1/edges/{name}/heartbeat``)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from federation.api.fields import StrictBooleanField, StrictCharField
from federation.api.serializers import InputSerializer
from regions.tables.schema import MAX_EDGE_WORKERS

#: More reports than this in one heartbeat is not an edge talking.
MAX_INSTANCE_REPORTS = 10_000
MAX_BUDGET_REPORTS = 100_000
MAX_COLD_REPORTS = 1_000


class InstanceReportInput(InputSerializer):
    id = StrictCharField(max_length=63, help_text="Instance id as in the routing table.")
    healthy = StrictBooleanField(help_text="Admitted by the edge's health checks.")
    in_flight = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False)
    queued = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False)
    kv_cache_usage = serializers.FloatField(min_value=0.0, max_value=1.0, required=False)
    tokens_per_s = serializers.FloatField(
        min_value=0.0,
        max_value=1e9,
        required=False,
        help_text="Tokens per second this edge sent the instance lately (prompt + output): "
        "summed over the region's edges, the demand the table compiler splits.",
    )
    overflow = serializers.IntegerField(
        min_value=0,
        max_value=1_000_000,
        required=False,
        help_text="Its share of the requests this edge is serving in other regions for want of "
        "capacity here (the model's count spread over its instances): demand the autoscaler "
        "counts with the queue.",
    )


class BudgetReportInput(InputSerializer):
    tenant = StrictCharField(max_length=63)
    key = StrictCharField(
        max_length=32, allow_blank=True, help_text="A key's public prefix; '' = the tenant's."
    )
    committed = serializers.IntegerField(
        min_value=0,
        max_value=10**24,
        help_text="pico-USD of the budget this edge has committed this month (settled + "
        "the worst case of requests in flight), when more than the table counted.",
    )


class ColdReportInput(InputSerializer):
    model = StrictCharField(max_length=200, help_text="A cold model of the edge's table.")
    held = serializers.IntegerField(
        min_value=0, max_value=1_000_000, help_text="Requests the edge holds for it now."
    )
    arrived = serializers.IntegerField(
        min_value=0,
        max_value=1_000_000,
        help_text="Requests for it since the previous heartbeat (held, refused or spilled).",
    )


class HeartbeatInput(InputSerializer):
    applied_table_version = serializers.IntegerField(
        min_value=1,
        allow_null=True,
        required=False,
        help_text="Version of the routing table the edge serves from (null: none yet).",
    )
    worker = serializers.IntegerField(
        min_value=0,
        max_value=MAX_EDGE_WORKERS - 1,
        required=False,
        default=0,
        help_text="Which of the edge's worker processes reports (0: the first, or the only "
        "one). Worker 0 reports the table version and budgets; every worker its instances' "
        "load and its cold demand, added up with the others'.",
    )
    workers = serializers.IntegerField(
        min_value=1,
        max_value=MAX_EDGE_WORKERS,
        required=False,
        default=1,
        help_text="Worker processes the edge runs on its port (each holds its own budget "
        "leases and counts as one of the region's edges for rate-limit shares). Believed up "
        "to the edge's max_workers, clamped above it; a worker at or above it is refused.",
    )
    instances = serializers.ListField(
        child=InstanceReportInput(), max_length=MAX_INSTANCE_REPORTS, required=False, default=list
    )
    budgets = serializers.ListField(
        child=BudgetReportInput(), max_length=MAX_BUDGET_REPORTS, required=False, default=list
    )
    cold = serializers.ListField(
        child=ColdReportInput(),
        max_length=MAX_COLD_REPORTS,
        required=False,
        help_text="Demand for the table's cold models (scaled to zero): what wakes them.",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["worker"] >= attrs["workers"]:
            raise serializers.ValidationError(
                {"worker": [f"Worker {attrs['worker']} of {attrs['workers']} does not exist."]}
            )
        return attrs

    def validate_cold(self, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        models = [r["model"] for r in value]
        if len(set(models)) != len(models):
            raise serializers.ValidationError("A model is reported twice.")
        return value

    def validate_instances(self, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        seen: set[str] = set()
        for report in value:
            if report["id"] in seen:
                raise serializers.ValidationError(f"Instance {report['id']!r} is reported twice.")
            seen.add(report["id"])
        return value


class HeartbeatOutput(serializers.Serializer):
    edge = serializers.CharField()
    applied_table_version = serializers.IntegerField(allow_null=True)
    latest_table_version = serializers.IntegerField(
        allow_null=True, help_text="Latest version published for the edge's region."
    )
    updated_instances = serializers.ListField(child=serializers.CharField())
    unknown_instances = serializers.ListField(
        child=serializers.CharField(),
        help_text="Reported ids that are not instances of the edge's region (ignored).",
    )
