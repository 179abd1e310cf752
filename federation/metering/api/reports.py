"""Usage and cost reports: ``GET /api/v1/usage/``, a tenant's monthly statement
``GET /api/v1/usage/statement/`` and ``GET /api/v1/costs/``, JSON or CSV.

Who reads what: admins and operators see every tenant, with the operator's cost and the margin;
a tenant viewer, or an API key with the ``usage:read`` scope (``Authorization: Bearer fi_…``),
sees its own tenant's usage and price only — the filter is forced, not asked for. Pool costs
are for admins and operators.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django.contrib.auth.models import AnonymousUser
from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.authentication import BaseAuthentication, SessionAuthentication
from rest_framework.exceptions import AuthenticationFailed, NotFound, PermissionDenied
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response

from federation.api.permissions import IsStaff
from federation.api.schema import FIELD_ERRORS, FORBIDDEN, UNAUTHENTICATED
from federation.api.views import EndpointView
from federation.core.csv_export import csv_attachment
from federation.core.roles import TENANT_VIEWER, is_staff_role, role_of
from federation.metering.models import DIMENSIONS
from federation.metering.selectors import (
    KeySpend,
    UsageQuery,
    pool_cost_report,
    tenant_statement,
    usage_report,
)
from federation.tenancy.api.authentication import TokenAuthentication
from federation.tenancy.api.serializers import tenant_slug_of
from federation.tenancy.models import ApiKey, Tenant
from federation.tenancy.selectors import api_key_authenticate

USAGE_READ = ApiKey.Scope.USAGE_READ.value
#: The longest range a report covers: hours for a month, days for a year and a bit.
MAX_RANGE = {"hour": timedelta(days=31), "day": timedelta(days=400), None: timedelta(days=400)}


class UsageKeyAuthentication(BaseAuthentication):
    """``Authorization: Bearer fi_…`` with the ``usage:read`` scope: its tenant's usage."""

    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header.startswith("Bearer fi_"):
            return None
        key = api_key_authenticate(key=header.removeprefix("Bearer ").strip())
        if key is None:
            raise AuthenticationFailed("Invalid, expired or revoked API key.")
        if USAGE_READ not in key.scopes:
            raise PermissionDenied("This API key has no 'usage:read' scope.")
        return AnonymousUser(), key

    def authenticate_header(self, request: Request) -> str:
        return "Bearer"


def reader_tenant(request: Request) -> str | None:
    """The tenant whose usage alone the caller may read (None: any tenant, with cost)."""
    if isinstance(request.auth, ApiKey):
        return request.auth.tenant.slug
    if is_staff_role(request.user):
        return None
    slug = tenant_slug_of(request.user) if role_of(request.user) == TENANT_VIEWER else None
    if slug is None:
        raise PermissionDenied("Your role does not allow this.")
    return slug


class CanReadUsage(BasePermission):
    message = "Log in, or use an API key with the 'usage:read' scope."

    def has_permission(self, request: Any, view: Any) -> bool:
        return isinstance(request.auth, ApiKey) or role_of(request.user) is not None


def _moment(value: datetime | date) -> datetime:
    if isinstance(value, datetime):
        return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.combine(value, time(0), tzinfo=UTC)


class RangeInput(serializers.Serializer):
    """A time range (dates are UTC midnight; the end is excluded) and a time bucket."""

    start = serializers.DateTimeField(
        input_formats=["iso-8601", "%Y-%m-%d"], help_text="Start, included (date or time)."
    )
    end = serializers.DateTimeField(
        input_formats=["iso-8601", "%Y-%m-%d"], help_text="End, excluded (date or time)."
    )
    bucket = serializers.ChoiceField(choices=["hour", "day"], required=False, allow_null=True)
    #: Not ``format``: DRF reads that one itself, to pick a renderer.
    output = serializers.ChoiceField(choices=["json", "csv"], default="json")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        start, end = _moment(attrs["start"]), _moment(attrs["end"])
        if end <= start:
            raise serializers.ValidationError({"end": ["must be after start"]})
        bucket = attrs.get("bucket")
        if end - start > MAX_RANGE[bucket]:
            raise serializers.ValidationError(
                {"end": [f"a report by {bucket or 'range'} covers at most {MAX_RANGE[bucket]}"]}
            )
        return {**attrs, "start": start, "end": end}


def _csv_list(value: str) -> list[str]:
    return [v for v in (x.strip() for x in value.split(",")) if v]


class UsageQueryInput(RangeInput):
    group_by = serializers.CharField(
        required=False, default="", help_text=f"Comma-separated, of {', '.join(DIMENSIONS)}."
    )
    tenant = serializers.CharField(required=False, help_text="Comma-separated slugs.")
    model = serializers.CharField(required=False)
    region = serializers.CharField(required=False)
    pool = serializers.CharField(required=False, help_text="Comma-separated '<region>/<pool>'.")

    def validate_group_by(self, value: str) -> list[str]:
        names = _csv_list(value)
        unknown = [n for n in names if n not in DIMENSIONS]
        if unknown or len(set(names)) != len(names):
            raise serializers.ValidationError(f"group_by takes distinct names of {DIMENSIONS}")
        return names


class PoolCostQueryInput(RangeInput):
    # A field, not a raw query parameter: DRF refuses NUL characters, which PostgreSQL cannot
    # compare (the fuzzer's ``?pool=…%00`` was a 500).
    pool = serializers.CharField(
        required=False, default="", allow_blank=True, help_text="Comma-separated '<region>/<pool>'."
    )


def _render(rows: list[dict[str, Any]], fmt: str, name: str) -> HttpResponse | Response:
    if fmt == "json":
        return Response({"results": rows})
    return csv_attachment(rows, name)


def _text(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Exact decimals as strings, days and hours in ISO 8601 (JSON and CSV alike)."""
    return [
        {k: (v.isoformat() if isinstance(v, date) else str(v) if k.endswith("_usd") else v)
         for k, v in row.items()}
        for row in rows
    ]  # fmt: skip


_QUERY = [
    OpenApiParameter("start", OpenApiTypes.DATETIME, required=True),
    OpenApiParameter("end", OpenApiTypes.DATETIME, required=True),
    OpenApiParameter("bucket", OpenApiTypes.STR, enum=["hour", "day"]),
    OpenApiParameter("output", OpenApiTypes.STR, enum=["json", "csv"]),
]
_REPORT = OpenApiResponse(description="{results: [rows]} (JSON), or text/csv.")


class UsageReportView(EndpointView):
    """Requests, tokens and price summed by tenant, model, region and pool, by hour or day."""

    authentication_classes = [UsageKeyAuthentication, TokenAuthentication, SessionAuthentication]
    permission_classes = [CanReadUsage]

    @extend_schema(
        operation_id="usage_report",
        parameters=[
            *_QUERY,
            *(OpenApiParameter(d, OpenApiTypes.STR) for d in ("group_by", *DIMENSIONS)),
        ],
        responses={200: _REPORT, 400: FIELD_ERRORS, 401: UNAUTHENTICATED, 403: FORBIDDEN},
    )
    def get(self, request: Request) -> HttpResponse | Response:
        own = reader_tenant(request)
        q = self.validated(UsageQueryInput, request.query_params)
        filters = {d: _csv_list(q[d]) for d in DIMENSIONS if q.get(d)}
        if own is not None:
            filters["tenant"] = [own]
        rows = usage_report(
            UsageQuery(
                q["start"],
                q["end"],
                group_by=q["group_by"],
                bucket=q.get("bucket"),
                filters=filters,
                with_cost=own is None,
            )
        )
        return _render(_text(rows), q["output"], "usage")


class PoolCostReportView(EndpointView):
    """Each GPU pool's cost and where it went: allocated to usage, idle GPUs, warm idle."""

    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [IsStaff]
    staff_only = "read pool costs"

    @extend_schema(
        operation_id="pool_cost_report",
        parameters=[*_QUERY, OpenApiParameter("pool", OpenApiTypes.STR)],
        responses={200: _REPORT, 400: FIELD_ERRORS, 401: UNAUTHENTICATED, 403: FORBIDDEN},
    )
    def get(self, request: Request) -> HttpResponse | Response:
        q = self.validated(PoolCostQueryInput, request.query_params)
        pools = _csv_list(q["pool"])
        rows = pool_cost_report(start=q["start"], end=q["end"], bucket=q.get("bucket"), pools=pools)
        return _render(_text(rows), q["output"], "pool-costs")


class StatementInput(serializers.Serializer):
    month = serializers.RegexField(r"^\d{4}-(0[1-9]|1[0-2])$", help_text="The UTC month, YYYY-MM.")
    tenant = serializers.SlugField(
        required=False, help_text="Required for operators; a tenant's reader gets its own."
    )
    output = serializers.ChoiceField(choices=["json", "csv"], default="json")


class StatementView(EndpointView):
    """A tenant's statement for one month: requests, tokens and price by model, the total and
    its budget; ``final`` once the month's late records can no longer arrive (a week after its
    end) and every hour of it is rolled up; the spend
    of each of its keys (over all the prefixes a rotated key had) with the key's own budget."""

    authentication_classes = [UsageKeyAuthentication, TokenAuthentication, SessionAuthentication]
    permission_classes = [CanReadUsage]

    @extend_schema(
        operation_id="usage_statement",
        parameters=[
            OpenApiParameter("month", OpenApiTypes.STR, required=True, description="YYYY-MM"),
            OpenApiParameter("tenant", OpenApiTypes.STR),
            OpenApiParameter("output", OpenApiTypes.STR, enum=["json", "csv"]),
        ],
        responses={
            200: OpenApiResponse(description="The statement (JSON), or its lines as text/csv."),
            400: FIELD_ERRORS,
            401: UNAUTHENTICATED,
            403: FORBIDDEN,
            404: OpenApiResponse(description="No such tenant."),
        },
    )
    def get(self, request: Request) -> HttpResponse | Response:
        own = reader_tenant(request)
        q = self.validated(StatementInput, request.query_params)
        slug = own if own is not None else q.get("tenant")
        if slug is None:
            raise serializers.ValidationError({"tenant": ["required for operators"]})
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None or (own is not None and q.get("tenant") not in (None, own)):
            raise NotFound(f"No tenant {q.get('tenant') or slug!r}.")
        year, month = map(int, q["month"].split("-"))
        statement = tenant_statement(tenant=tenant, month=date(year, month, 1), now=timezone.now())
        lines = _text(
            [{k: v for k, v in line.items() if k != "cost_usd"} for line in statement.lines]
        )
        if q["output"] == "csv":
            total = {k: "" for k in lines[0]} if lines else {"model": "", "price_usd": ""}
            total.update(model="TOTAL", price_usd=str(statement.total_usd))
            return _render([*lines, total], "csv", f"statement-{slug}-{q['month']}")
        budget = statement.monthly_budget_usd
        return Response(
            {
                "tenant": statement.tenant,
                "month": q["month"],
                "currency": "USD",
                "lines": lines,
                "total_usd": str(statement.total_usd),
                "monthly_budget_usd": None if budget is None else str(budget),
                "budget_used": None if not budget else float(statement.total_usd / budget),
                "final": statement.final,
                "keys": [_key_line(key) for key in statement.keys],
            }
        )


def _key_line(key: KeySpend) -> dict[str, Any]:
    budget = key.monthly_budget_usd
    return {
        "id": key.key_id,
        "name": key.name,
        "prefix": key.prefix,
        "spent_usd": str(key.spent_usd),
        "monthly_budget_usd": None if budget is None else str(budget),
        "budget_used": None if not budget else float(key.spent_usd / budget),
    }
