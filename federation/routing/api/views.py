"""Distribution API views: load, check who asks, call one service or selector, answer. (What
edges send back, their heartbeats and usage, is ``federation.telemetry``'s and
``federation.metering``'s.)"""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse, HttpResponseBase
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from federation.api.pagination import query_whole_number
from federation.api.schema import FIELD_ERRORS, FORBIDDEN, NOT_FOUND, UNAUTHENTICATED
from federation.api.views import EndpointView, ReadViewSet, nul_free_or_404
from federation.inventory.models import Edge, Region
from federation.routing import distribution, services
from federation.routing.api import serializers as s
from federation.routing.api.longpoll import WAITED, WaitFor
from federation.tenancy.api.authentication import (
    EDGE_OR_STAFF_AUTHENTICATION,
    authenticated_edge,
)
from federation.tenancy.api.permissions import IsEdgeOrStaff

#: Longest long-poll a client may ask for, seconds.
MAX_WAIT_S = 30


def _etag(version: int) -> str:
    return f'"{version}"'


def _known_version(request: Request) -> int | None:
    """The version named by ``If-None-Match`` (``"7"``, ``W/"7"`` or ``7``), else None."""
    raw = request.headers.get("If-None-Match", "").strip()
    if raw.startswith("W/"):
        raw = raw[2:]
    raw = raw.strip('"')
    return int(raw) if raw.isdigit() and len(raw) < 20 else None


def _region(code: str) -> Region:
    nul_free_or_404(code)
    found = Region.objects.filter(code=code).first()
    if found is None:
        raise NotFound(f"No {Region._meta.verbose_name} {code!r}.")
    return found


# An ETag and a long-poll (``longpoll.py``): a view of its own, not a viewset's detail.
class RoutingTableView(EndpointView):
    """The latest routing table of a region, for its edges (and staff)."""

    authentication_classes = EDGE_OR_STAFF_AUTHENTICATION
    permission_classes = [IsEdgeOrStaff]

    @extend_schema(
        operation_id="edge_routing_table",
        parameters=[
            OpenApiParameter(
                "wait",
                OpenApiTypes.INT,
                description=f"Long-poll: when the client already has the latest version "
                f"(If-None-Match), hold the request up to this many seconds (0-{MAX_WAIT_S}) "
                f"for a newer one.",
            ),
            OpenApiParameter(
                "If-None-Match",
                OpenApiTypes.STR,
                location=OpenApiParameter.HEADER,
                description='The ETag (version) the client has, e.g. "7".',
            ),
        ],
        responses={
            200: OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="The routing-table document (docs/routing-table.md); ETag is its "
                "version.",
            ),
            304: OpenApiResponse(description="The client's version is still the latest."),
            503: OpenApiResponse(
                description="No table published for the region yet; see Retry-After (with "
                "wait, the request is held for the first one)."
            ),
            400: FIELD_ERRORS,
            401: UNAUTHENTICATED,
            403: FORBIDDEN,
            404: NOT_FOUND,
        },
    )
    def get(self, request: Request, region: str, **kwargs: Any) -> HttpResponseBase:
        wait = query_whole_number(request, "wait", 0) or 0
        if wait > MAX_WAIT_S:
            raise ValidationError({"wait": [f"Must be at most {MAX_WAIT_S}."]})
        target = _region(region)
        edge = authenticated_edge(request)
        if edge is not None and edge.region_id != target.pk:
            raise PermissionDenied(
                f"Edge {edge.name} belongs to region {edge.region.code}; it may not read the "
                f"table of {target.code}."
            )
        known = _known_version(request)
        # A read never compiles: tables are published by the worker, after every change (an
        # edge's registration included) and periodically.
        table = distribution.routing_table_latest_signed(region=target)
        # Versions only grow, so a client at or above the latest has nothing to fetch (one
        # above it, after a database restore, keeps its table instead of looping on ours).
        if table is not None and (known is None or table.version > known):
            # The signed bytes as they are: rendering them again per edge is what cost.
            response = HttpResponse(table.body, content_type="application/json")
            response["ETag"] = _etag(table.version)
            response["Cache-Control"] = "no-cache"
            return response
        if wait and not kwargs.get(WAITED):
            response = Response(status=status.HTTP_304_NOT_MODIFIED)
            response.wait_for = WaitFor(  # type: ignore[attr-defined]
                region_id=target.pk, region_code=target.code, known=known, seconds=wait
            )
            return response
        if table is None:
            # Nothing published yet (the worker's first publish is on its way): try again soon.
            response = Response(
                {"detail": f"No routing table published for {target.code} yet."},
                status=status.HTTP_503_SERVICE_UNAVAILABLE,
            )
            response["Retry-After"] = "1"
            return response
        response = Response(status=status.HTTP_304_NOT_MODIFIED)
        response["ETag"] = _etag(table.version)
        return response


class EdgeCredentialRotateView(EndpointView):
    """Issue a new credential for an edge; the old one stops working."""

    @extend_schema(
        operation_id="edge_rotate_credential",
        parameters=[OpenApiParameter("id", int, OpenApiParameter.PATH)],
        request=None,
        responses={
            200: s.EdgeCredentialOutput,
            401: UNAUTHENTICATED,
            403: FORBIDDEN,
            404: NOT_FOUND,
        },
    )
    def post(self, request: Request, pk: str) -> Response:
        edge: Edge = self.object_or_404(Edge.objects.select_related("region"), pk=pk)
        credential = services.edge_credential_rotate(actor=request.user, edge=edge)
        out = {"id": edge.pk, "name": edge.name, "region": edge.region.code}
        return Response(s.EdgeCredentialOutput({**out, "credential": credential}).data)


class RoutingTableOverviewViewSet(ReadViewSet):
    """Each region's latest table version and the edges running it."""

    lookup_field = "code"
    queryset = Region.objects.none()
    selector = staticmethod(distribution.routing_table_overview)
    output_serializer = s.RegionTableOutput
    ordering_fields = ("code", "latest_version")
