"""Reads for metering: usage and cost reports from the hourly rollups; spend and prices for
the budgets the routing tables carry.

Reports read ``UsageHour`` and ``PoolHour`` only (hundreds of rows per hour, not one per
request), so a month over millions of requests is summed from a few hundred thousand rows.
Amounts are exact decimals: a report's total is the sum of its rows to the last digit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any, Literal

from django.db import connection
from django.db.models import DecimalField, Q, QuerySet, Sum
from django.db.models.functions import TruncDate

from federation.metering.admission import USAGE_LATE_LIMIT
from federation.metering.models import (
    USAGE_SUMS,
    CountedSpend,
    Dimension,
    ModelPrice,
    PoolHour,
    StaleUsageHour,
    UsageDay,
    UsageDeadLetter,
    UsageHour,
    UsageRecord,
)
from federation.metering.pricing import Price
from federation.tenancy.models import ApiKey, ApiKeyPrefix, Tenant

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
    #: Only these sums (of ``USAGE_SUMS`` and ``margin_usd``; empty: all of them). A chart of
    #: one metric over thousands of groups then sums one column per row instead of eight.
    only: Sequence[str] = ()


#: What a report can sum: the rollups' sums and the margin derived from two of them.
REPORT_SUMS = frozenset({*USAGE_SUMS, "margin_usd"})


def _midnight(moment: datetime) -> bool:
    return moment.astimezone(UTC).time() == time(0)


def _usage_rows(query: UsageQuery) -> tuple[QuerySet[Any], list[str]]:
    """The rollup rows ``query`` reads, filtered, and its time key (none, or its bucket).
    Whole UTC days not bucketed by hour are read from the daily rollups, anything else from
    the hourly ones."""
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
    return rows, time_keys


def _summed(query: UsageQuery) -> tuple[list[str], bool]:
    """(the rollup columns ``query`` sums, whether it adds the margin)."""
    unknown = set(query.only) - REPORT_SUMS
    if unknown:
        raise ValueError(f"no such usage sum: {', '.join(sorted(unknown))}")
    wanted = set(query.only or REPORT_SUMS)
    margin = query.with_cost and "margin_usd" in wanted
    if margin:
        wanted |= {"price_usd", "cost_usd"}
    columns = [
        name for name in USAGE_SUMS if name in wanted and (query.with_cost or name != "cost_usd")
    ]
    if not columns:
        raise ValueError("nothing to sum: cost and margin are for reports with cost")
    return columns, margin


def usage_report(query: UsageQuery) -> list[dict[str, Any]]:
    """Usage summed by ``group_by`` (and time bucket), ordered by them (``_usage_rows``)."""
    rows, time_keys = _usage_rows(query)
    keys = [*time_keys, *query.group_by]
    columns, margin = _summed(query)
    sums: dict[str, Any] = {name: Sum(name, default=0) for name in columns}
    if keys:
        report = list(rows.values(*keys).annotate(**sums).order_by(*keys))
    else:
        report = [rows.aggregate(**sums)]
    if margin:
        for row in report:
            row["margin_usd"] = row["price_usd"] - row["cost_usd"]
    return report


def usage_report_by_group_and_bucket(
    query: UsageQuery, group: Dimension
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``usage_report`` of ``query`` (with its bucket) by ``group`` alone and by bucket alone,
    from one pass over the rollups (PostgreSQL's ``GROUPING SETS``): ranking thousands of
    tenants and charting their total over time read the month's rows once, not twice. Two
    reports when the two read different rollups (whole days by hour) or on another database."""
    assert query.bucket is not None and not query.group_by, "a bucket and no group_by"
    by_group = dataclasses.replace(query, group_by=[group], bucket=None)
    rows, (time_key,) = _usage_rows(query)
    if connection.vendor != "postgresql" or rows.model is not _usage_rows(by_group)[0].model:
        return usage_report(by_group), usage_report(query)
    columns, margin = _summed(query)
    inner, params = rows.order_by().values(time_key, group, *columns).query.sql_with_params()
    # The inner query's columns are named after the fields (group, columns from fixed lists).
    sums = ", ".join(f'COALESCE(SUM(u."{c}"), 0) AS "{c}"' for c in columns)
    sql = (
        f'SELECT GROUPING(u."{group}") AS by_bucket, u."{time_key}", u."{group}", {sums} '
        f'FROM ({inner}) AS u GROUP BY GROUPING SETS ((u."{group}"), (u."{time_key}")) '
        f'ORDER BY 1, u."{group}", u."{time_key}"'
    )
    integer = {c for c in columns if not isinstance(UsageDay._meta.get_field(c), DecimalField)}
    groups: list[dict[str, Any]] = []
    buckets: list[dict[str, Any]] = []
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for by_bucket, bucket, value, *totals in cursor.fetchall():
            row = {c: int(t) if c in integer else t for c, t in zip(columns, totals, strict=True)}
            if margin:
                row["margin_usd"] = row["price_usd"] - row["cost_usd"]
            if by_bucket:  # GROUPING(group) = 1: summed over the groups
                buckets.append({time_key: bucket, **row})
            else:
                groups.append({group: value, **row})
    return groups, buckets


@dataclass(frozen=True, slots=True)
class KeySpend:
    """What one API key spent in a month, under all the prefixes it had, and its own budget."""

    key_id: int
    name: str
    prefix: str
    spent_usd: Decimal
    monthly_budget_usd: Decimal | None


def key_month_spend(*, tenant: Tenant, month: date) -> list[KeySpend]:
    """The month's spend of each key of ``tenant`` that spent or has a budget, as counted at
    ingestion (three queries). Records name a key by the prefix its secret had, so a rotated
    key's spend is summed over every prefix it had (``ApiKeyPrefix``)."""
    by_prefix = dict(
        CountedSpend.objects.filter(month=month, tenant=tenant.slug)
        .exclude(key_prefix="")
        .values("key_prefix")
        .annotate(spent=Sum("price_usd"))
        .values_list("key_prefix", "spent")
    )
    spent: dict[int, Decimal] = {}
    owners = ApiKeyPrefix.objects.filter(prefix__in=list(by_prefix), api_key__tenant=tenant)
    for key_id, prefix in owners.values_list("api_key_id", "prefix"):
        spent[key_id] = spent.get(key_id, Decimal(0)) + by_prefix[prefix]
    keys = ApiKey.objects.filter(tenant=tenant).filter(
        Q(pk__in=list(spent)) | Q(monthly_budget_usd__isnull=False)
    )
    return [
        KeySpend(
            key.pk, key.name, key.prefix, spent.get(key.pk, Decimal(0)), key.monthly_budget_usd
        )
        for key in keys.order_by("name", "id")
    ]


@dataclass(frozen=True, slots=True)
class Statement:
    """A tenant's bill for one UTC month: a line per model, the total, and its budget."""

    tenant: str
    month: date
    lines: list[dict[str, Any]]
    total_usd: Decimal
    monthly_budget_usd: Decimal | None
    #: The month ended :data:`~federation.metering.admission.USAGE_LATE_LIMIT` ago (no record
    #: of it is admitted any more) and every hour of it is rolled up: the figures are final.
    final: bool
    #: Its keys' spend (those that spent or have a budget of their own).
    keys: list[KeySpend] = field(default_factory=list)


def tenant_statement(*, tenant: Tenant, month: date, now: datetime) -> Statement:
    """``tenant``'s statement for the month starting ``month`` (its first day), from the daily
    rollups: what it was charged, by model, to the last digit."""
    start = datetime.combine(month, time(0), tzinfo=UTC)
    end = datetime.combine((month + timedelta(days=32)).replace(day=1), time(0), tzinfo=UTC)
    lines = usage_report(
        UsageQuery(start, end, group_by=("model",), filters={"tenant": [tenant.slug]})
    )
    lines = [line for line in lines if line["requests"]]
    stale = StaleUsageHour.objects.filter(hour__gte=start, hour__lt=end).exists()
    return Statement(
        tenant=tenant.slug,
        month=month,
        lines=lines,
        total_usd=sum((line["price_usd"] for line in lines), start=Decimal(0)),
        monthly_budget_usd=tenant.monthly_budget_usd,
        final=now >= end + USAGE_LATE_LIMIT and not stale,
        keys=key_month_spend(tenant=tenant, month=month),
    )


def tenant_month_spend(*, now: datetime) -> dict[str, Decimal]:
    """Tenant slug -> price of its usage this calendar month (UTC) so far, as counted at
    ingestion (current the moment a batch commits; the rollups may lag)."""
    rows = (
        CountedSpend.objects.filter(month=month_of(now))
        .values("tenant")
        .annotate(spent=Sum("price_usd"))
        .values_list("tenant", "spent")
    )
    return dict(rows)


def month_of(now: datetime) -> date:
    """The first day of ``now``'s UTC month (the key of :class:`CountedSpend`)."""
    return now.astimezone(UTC).date().replace(day=1)


def counted_spend(
    *, month: date, tenants: Iterable[str]
) -> dict[str, dict[tuple[str, str], Decimal]]:
    """Tenant -> (key prefix, edge) -> spend counted in ``month``, for ``tenants``."""
    spent: dict[str, dict[tuple[str, str], Decimal]] = {}
    rows = CountedSpend.objects.filter(month=month, tenant__in=list(tenants)).values_list(
        "tenant", "key_prefix", "edge", "price_usd"
    )
    for tenant, key, edge, usd in rows:
        spent.setdefault(tenant, {})[(key, edge)] = usd
    return spent


@dataclass(frozen=True, slots=True)
class PricesInEffect:
    """The list price of every priced model, and tenants' own prices, at one moment."""

    list_prices: dict[str, Price]
    tenant_prices: dict[str, dict[str, Price]]


def prices_in_effect(*, now: datetime, tenants: Iterable[str] | None = None) -> PricesInEffect:
    """The prices in effect at ``now`` (the latest row from at or before it), list prices and
    the own prices of ``tenants`` (all tenants when None)."""
    rows = ModelPrice.objects.filter(effective_from__lte=now).select_related("model", "tenant")
    if tenants is not None:
        rows = rows.filter(Q(tenant__isnull=True) | Q(tenant__slug__in=list(tenants)))
    list_prices: dict[str, Price] = {}
    tenant_prices: dict[str, dict[str, Price]] = {}
    for row in rows.order_by("-effective_from"):
        price = Price(row.input_per_mtok, row.cached_input_per_mtok, row.output_per_mtok)
        into = list_prices if row.tenant is None else tenant_prices.setdefault(row.tenant.slug, {})
        into.setdefault(row.model.name, price)
    return PricesInEffect(list_prices, tenant_prices)


def pool_cost_report(
    *, start: datetime, end: datetime, bucket: Bucket | None = None, pools: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Each pool's cost and where it went (allocated, idle, warm idle, and the re-prefills of
    continued streams, the operator's), by time bucket."""
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
            reprefill_usd=Sum("reprefill_usd"),
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


def usage_dead_letters(
    *, source: str | None = None, edge: str | None = None
) -> QuerySet[UsageDeadLetter]:
    """Refused usage documents, newest first, optionally of one source or edge."""
    letters = UsageDeadLetter.objects.order_by("-id")
    if source:
        letters = letters.filter(source=source)
    if edge:
        letters = letters.filter(edge=edge)
    return letters
