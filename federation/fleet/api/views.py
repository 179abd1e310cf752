"""``POST /api/v1/placement/plan/`` (a dry run: the diff the planner proposes),
``POST /api/v1/placement/apply/`` (apply a plan by id, or plan and apply at once) and
``GET /api/v1/placement/plans/`` (the plans kept, newest first: the operators' and the worker's
scheduled ones). Admins and operators only."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from federation.api.permissions import IsStaff
from federation.api.schema import NOT_FOUND
from federation.api.views import EndpointView
from federation.fleet import placing
from federation.fleet.api.serializers import ApplyInput, PlanInput, PlanOutput
from federation.fleet.models import PlacementPlan
from federation.fleet.placement_inputs import DemandOverride


def _override(data: dict[str, Any]) -> list[DemandOverride] | None:
    if "demand" not in data:
        return None
    return [DemandOverride(**row) for row in data["demand"]]


class PlacementPlanView(EndpointView):
    permission_classes = [IsStaff]
    staff_only = "plan the fleet's placement"

    @extend_schema(request=PlanInput, responses={201: PlanOutput})
    def post(self, request: Request) -> Response:
        """Plan the placement against the fleet as it is now; nothing in the fleet changes."""
        data = self.validated(PlanInput, request.data)
        plan = placing.placement_plan(
            actor=request.user, override=_override(data), window_hours=data["window_hours"]
        )
        return Response(PlanOutput(plan).data, status=status.HTTP_201_CREATED)


class PlacementApplyView(EndpointView):
    permission_classes = [IsStaff]
    staff_only = "apply placement plans"

    @extend_schema(request=ApplyInput, responses={200: PlanOutput, 201: PlanOutput, 404: NOT_FOUND})
    def post(self, request: Request) -> Response:
        """Apply a plan (200; again: nothing more happens), or plan and apply at once (201);
        409 when the fleet changed since the plan."""
        data = self.validated(ApplyInput, request.data)
        if "plan" in data:
            plan = self.object_or_404(PlacementPlan, pk=data["plan"])
            plan, _ = placing.placement_apply(actor=request.user, plan=plan)
            return Response(PlanOutput(plan).data)
        plan = placing.placement_plan_and_apply(
            actor=request.user, override=_override(data), window_hours=data["window_hours"]
        )
        return Response(PlanOutput(plan).data, status=status.HTTP_201_CREATED)


class PlacementPlansView(ListAPIView[PlacementPlan]):
    """The plans kept, newest first: what the worker's scheduled pass planned (and whether it
    applied it) and the operators' own."""

    permission_classes = [IsStaff]
    staff_only = "read placement plans"
    serializer_class = PlanOutput
    queryset = PlacementPlan.objects.all()
