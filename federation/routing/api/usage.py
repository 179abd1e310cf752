"""Usage from the edges over HTTP: for a control plane without Redis (the embedded demo)."""

from __future__ import annotations

import logging
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.parsers import BaseParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from federation.api.schema import FORBIDDEN, NOT_FOUND, UNAUTHENTICATED
from federation.api.views import nul_free_or_404
from federation.core.metrics import USAGE_REJECTED
from federation.inventory.models import Edge
from federation.metering.admission import UsageSender
from federation.metering.models import UsageDeadLetter
from federation.metering.services import usage_ingest
from federation.routing.api.authentication import (
    EdgeCredentialAuthentication,
    authenticated_edge,
)
from federation.routing.api.permissions import IsEdge
from federation.routing.services import routing_tables_schedule_budget_release

log = logging.getLogger("fedinfer.metering")


class NdjsonParser(BaseParser):
    """Newline-delimited documents, kept as bytes (each is decoded by ingestion)."""

    media_type = "application/x-ndjson"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        return [line for line in stream.read().split(b"\n") if line.strip()]


class EdgeUsageView(APIView):
    """Usage records of the requests an edge served, one JSON document a line; each stored (once,
    however often sent) or refused into the dead-letter before the answer, so a 2xx means the
    edge may drop them. The answer lists the refused ones by their place in the body (0-based,
    blank lines not counted) with why."""

    authentication_classes = [EdgeCredentialAuthentication]
    permission_classes = [IsEdge]
    parser_classes = [NdjsonParser]

    @extend_schema(
        operation_id="edge_usage",
        request={"application/x-ndjson": OpenApiTypes.BINARY},
        responses={
            200: OpenApiResponse(
                description="Stored: {accepted, rejected: [{index, reason}, ...]}: every "
                "record is either stored or kept in the dead-letter, so the edge drops the batch."
            ),
            401: UNAUTHENTICATED,
            403: FORBIDDEN,
            404: NOT_FOUND,
        },
    )
    def post(self, request: Request, name: str) -> Response:
        nul_free_or_404(name)
        target = Edge.objects.select_related("region").filter(name=name).first()
        if target is None:
            raise NotFound(f"No edge {name!r}.")
        edge = authenticated_edge(request)
        if edge is None or edge.pk != target.pk:
            raise PermissionDenied("An edge may report usage only for itself.")
        data = request.data
        documents = [d for d in data if isinstance(d, bytes)] if isinstance(data, list) else []
        result = usage_ingest(
            documents=documents,
            sender=UsageSender(edge=name, region=target.region.code),
            source=UsageDeadLetter.Source.HTTP,
        )
        if result.budgeted:
            routing_tables_schedule_budget_release()
        rejected = [{"index": r.index, "reason": r.reason} for r in result.rejected]
        USAGE_REJECTED.inc(len(rejected))
        if rejected:
            log.error("edge %s: %d usage records refused: %s", name, len(rejected), rejected[:5])
        return Response({"accepted": result.accepted, "rejected": rejected})
