"""``GET /api/v1/usage/dead-letters/`` (usage documents refused at ingestion, newest first) and
``POST /api/v1/usage/dead-letters/{id}/replay/`` (run one through the checks again as the edge
that sent it: stored and removed when it now passes, else kept with the new reason). Admins
and operators only; replays are audited."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from federation.api.permissions import IsStaff
from federation.api.schema import FORBIDDEN, NOT_FOUND, UNAUTHENTICATED
from federation.api.views import EndpointView
from federation.metering.models import UsageDeadLetter
from federation.metering.selectors import usage_dead_letters
from federation.metering.services import usage_dead_letter_replay

#: How much of a document the listing shows (the whole of it stays in the database).
PREVIEW_BYTES = 2048


class DeadLetterOutput(serializers.ModelSerializer[UsageDeadLetter]):
    document = serializers.SerializerMethodField(
        help_text=f"The refused document (UTF-8, invalid bytes replaced), its first "
        f"{PREVIEW_BYTES} bytes."
    )

    class Meta:
        model = UsageDeadLetter
        fields = [
            "id",
            "received_at",
            "source",
            "edge",
            "region",
            "authenticated",
            "truncated",
            "reason",
            "document",
        ]

    def get_document(self, obj: UsageDeadLetter) -> str:
        return bytes(obj.document[:PREVIEW_BYTES]).decode("utf-8", "replace")


class ReplayOutput(serializers.Serializer[Any]):
    accepted = serializers.IntegerField(help_text="Records stored now (or stored before).")
    refused = serializers.ListField(
        child=serializers.CharField(), help_text="Why the rest is still refused (empty: removed)."
    )
    removed = serializers.BooleanField(help_text="The dead letter is gone: all of it passed.")


class DeadLettersView(ListAPIView[UsageDeadLetter]):
    """Refused usage documents, newest first (``?source=stream|http``, ``?edge=``)."""

    permission_classes = [IsStaff]
    staff_only = "read and replay usage dead letters"
    serializer_class = DeadLetterOutput

    @extend_schema(
        operation_id="usage_dead_letters",
        parameters=[
            OpenApiParameter("source", enum=[c.value for c in UsageDeadLetter.Source]),
            OpenApiParameter("edge", str),
        ],
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)

    def get_queryset(self) -> Any:
        params = self.request.query_params
        source = params.get("source") or None
        if source is not None and source not in UsageDeadLetter.Source.values:
            raise ValidationError(
                {"source": [f"one of {', '.join(UsageDeadLetter.Source.values)}"]}
            )
        return usage_dead_letters(source=source, edge=params.get("edge") or None)


class DeadLetterReplayView(EndpointView):
    permission_classes = [IsStaff]
    staff_only = "read and replay usage dead letters"

    @extend_schema(
        operation_id="usage_dead_letter_replay",
        parameters=[OpenApiParameter("id", int, OpenApiParameter.PATH)],
        request=None,
        responses={200: ReplayOutput, 401: UNAUTHENTICATED, 403: FORBIDDEN, 404: NOT_FOUND},
    )
    def post(self, request: Request, pk: str) -> Response:
        """Replay one dead letter; a second replay of a removed one is a 404 (JSON, as is a
        malformed id: the route takes any segment)."""
        letter = self.object_or_404(UsageDeadLetter, pk=pk)
        result = usage_dead_letter_replay(actor=request.user, letter=letter)
        body = {
            "accepted": result.accepted,
            "refused": result.refused,
            "removed": not result.refused,
        }
        return Response(ReplayOutput(body).data)
