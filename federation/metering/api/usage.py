"""Usage from the edges over HTTP: for a control plane without Redis (the embedded demo).
``POST /api/v1/edges/{name}/usage``, an edge's own credential only."""

from __future__ import annotations

import logging

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from federation.api.parsers import NdjsonParser
from federation.api.schema import FORBIDDEN, NOT_FOUND, UNAUTHENTICATED
from federation.api.views import EndpointView
from federation.core.changes import budget_spend_counted
from federation.core.metrics import USAGE_REJECTED
from federation.metering.admission import UsageSender
from federation.metering.models import UsageDeadLetter
from federation.metering.services import usage_ingest
from federation.tenancy.api.authentication import EdgeCredentialAuthentication
from federation.tenancy.api.permissions import IsEdge, edge_speaking_for_itself

log = logging.getLogger("fedinfer.metering")


class EdgeUsageView(EndpointView):
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
        target = edge_speaking_for_itself(request, name, doing="report usage")
        data = request.data
        documents = [d for d in data if isinstance(d, bytes)] if isinstance(data, list) else []
        result = usage_ingest(
            documents=documents,
            sender=UsageSender(edge=name, region=target.region.code),
            source=UsageDeadLetter.Source.HTTP,
        )
        if result.budgeted:
            # Routing re-leases what remains of the budgets (spaced); metering, below routing,
            # reaches it through the one table scheduler.
            budget_spend_counted()
        rejected = [{"index": r.index, "reason": r.reason} for r in result.rejected]
        USAGE_REJECTED.inc(len(rejected))
        if rejected:
            log.error("edge %s: %d usage records refused: %s", name, len(rejected), rejected[:5])
        return Response({"accepted": result.accepted, "rejected": rejected})
