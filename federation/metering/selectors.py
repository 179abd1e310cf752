"""Reads for metering: usage and cost reports from the hourly rollups.

Reports read ``UsageHour`` and ``PoolHour`` only (hundreds of rows per hour, not one per
request), so a month over millions of requests is summed from a few hundred thousand rows.
Amounts are exact decimals: a report's total is the sum of its rows to the last digit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, time
from decimal import Decimal
from typing import Any, Literal

from django.db.models import QuerySet, Sum
from django.db.models.functions import TruncDate

from federation.metering.models import (
    USAGE_SUMS,
    Dimension,
    PoolHour,
    UsageDay,
    UsageHour,
    UsageRecord,
)

Bucket = Literal["hour", "day"]


@dataclass(frozen=True, slots=True)
class UsageQuery:
    start: datetime
    end: datetime
    group_by: Sequence[Dimension] = ()
    bucket: Bucket | None = None
    #: Dimension -> the values to keep (e.g. ``{"tenant": ["acme"]}``: a tenant's own view).
    filters: Mapping[Dimension, Sequence[str]] = field(default_factory=dict)
    #: Add the operator's cost and the margin (price - cost): for operators only.
    with_cost: bool = False


def _midnight(moment: datetime) -> bool:
    return moment.astimezone(UTC).time() == time(0)


def usage_report(query: UsageQuery) -> list[dict[str, Any]]:
    """Usage summed by ``group_by`` (and time bucket), ordered by them. Whole UTC days not
    bucketed by hour are read from the daily rollups, anything else from the hourly ones."""
    if query.bucket != "hour" and _midnight(query.start) and _midnight(query.end):
        rows: QuerySet[Any] = UsageDay.objects.filter(
            day__gte=query.start.astimezone(UTC).date(), day__lt=query.end.astimezone(UTC).date()
        )
        time_keys = ["day"] if query.bucket == "day" else []
    else:
        rows = UsageHour.objects.filter(hour__gte=query.start, hour__lt=query.end)
        if query.bucket == "day":
            rows = rows.annotate(day=TruncDate("hour", tzinfo=UTC))
        time_keys = [query.bucket] if query.bucket else []
    for dimension, values in query.filters.items():
        rows = rows.filter(**{f"{dimension}__in": list(values)})
    keys = [*time_keys, *query.group_by]
    sums: dict[str, Any] = {
        name: Sum(name, default=0) for name in USAGE_SUMS if query.with_cost or name != "cost_usd"
    }
    if keys:
        report = list(rows.values(*keys).annotate(**sums).order_by(*keys))
    else:
        report = [rows.aggregate(**sums)]
    if query.with_cost:
        for row in report:
            row["margin_usd"] = row["price_usd"] - row["cost_usd"]
    return report


def tenant_month_spend(*, now: datetime) -> dict[str, Decimal]:
    """Tenant slug -> price of its usage this calendar month (UTC) so far, as rolled up."""
    first = now.astimezone(UTC).date().replace(day=1)
    rows = (
        UsageDay.objects.filter(day__gte=first)
        .values("tenant")
        .annotate(spent=Sum("price_usd"))
        .values_list("tenant", "spent")
    )
    return {tenant: spent for tenant, spent in rows if tenant}


def pool_cost_report(
    *, start: datetime, end: datetime, bucket: Bucket | None = None, pools: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Each pool's cost and where it went (allocated, idle, warm idle), by time bucket."""
    rows = PoolHour.objects.filter(hour__gte=start, hour__lt=end)
    if pools:
        rows = rows.filter(pool__in=list(pools))
    if bucket == "day":
        rows = rows.annotate(day=TruncDate("hour", tzinfo=UTC))
    keys = [bucket, "pool"] if bucket else ["pool"]
    return list(
        rows.values(*keys)
        .annotate(
            gpu_hours=Sum("gpus"),
            cost_usd=Sum("cost_usd"),
            allocated_usd=Sum("allocated_usd"),
            idle_usd=Sum("idle_usd"),
            warm_idle_usd=Sum("warm_idle_usd"),
            busy_s=Sum("busy_s"),
        )
        .order_by(*keys)
    )


def recent_requests(
    *, since: datetime, limit: int = 20_000
) -> list[tuple[str, str, float | None, int]]:
    """``(entry_region, region, ttft_ms, status)`` of the latest requests started since
    ``since``, newest first, at most ``limit``: the console's live TTFT and spill-over."""
    return list(
        UsageRecord.objects.filter(started_at__gte=since)
        .order_by("-started_at")
        .values_list("entry_region", "region", "ttft_ms", "status")[:limit]
    )
