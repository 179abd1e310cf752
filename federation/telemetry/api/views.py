"""An edge's heartbeat: check who sends it, validate it, store it through one service."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from federation.api.schema import CONFLICT, FIELD_ERRORS, FORBIDDEN, NOT_FOUND, UNAUTHENTICATED
from federation.api.views import EndpointView
from federation.routing.distribution import routing_table_latest_version
from federation.telemetry import heartbeats
from federation.telemetry.api import serializers as s
from federation.tenancy.api.authentication import EDGE_OR_STAFF_AUTHENTICATION
from federation.tenancy.api.permissions import IsEdge, edge_speaking_for_itself


class EdgeHeartbeatView(EndpointView):
    """An edge reports its liveness, applied table version and instances' health and load."""

    authentication_classes = EDGE_OR_STAFF_AUTHENTICATION
    permission_classes = [IsEdge]

    @extend_schema(
        operation_id="edge_heartbeat",
        request=s.HeartbeatInput,
        responses={
            200: s.HeartbeatOutput,
            400: FIELD_ERRORS,
            401: UNAUTHENTICATED,
            403: FORBIDDEN,
            404: NOT_FOUND,
            409: CONFLICT,
        },
    )
    def post(self, request: Request, name: str) -> Response:
        target = edge_speaking_for_itself(request, name, doing="send heartbeats")
        data = self.validated(s.HeartbeatInput, request.data)
        reports = [
            heartbeats.InstanceReport(
                id=r["id"],
                healthy=r["healthy"],
                load={k: v for k, v in r.items() if k not in {"id", "healthy"}},
            )
            for r in data["instances"]
        ]
        result = heartbeats.edge_heartbeat_record(
            edge=target,
            applied_table_version=data.get("applied_table_version"),
            worker=data["worker"],
            workers=data["workers"],
            instances=reports,
            budgets={(b["tenant"], b["key"]): b["committed"] for b in data["budgets"]},
            cold=(
                {c["model"]: (c["held"], c["arrived"]) for c in data["cold"]}
                if "cold" in data
                else None
            ),
        )
        out = {
            "edge": result.edge.name,
            "applied_table_version": result.edge.applied_table_version,
            "latest_table_version": routing_table_latest_version(region_id=result.edge.region_id),
            "updated_instances": result.updated_instances,
            "unknown_instances": result.unknown_instances,
        }
        return Response(s.HeartbeatOutput(out).data)
