"""Writes for metering: ingest usage records from the edges, keep the hourly rollups exact.

Ingestion is idempotent: a record is keyed by ``(started_at, request_id)``, both set by the edge
that served it, so the same record shipped twice (an edge restarted before its batch was
acknowledged, a worker killed after the commit but before it acknowledged the stream) is stored
once. Rollups are recomputed per hour from the records, never incremented, so they cannot drift
from what the records say.
"""

from __future__ import annotations

import uuid
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Count, F, Q, QuerySet, Sum
from django.utils import timezone

from federation.core.audit import Actor, audit_record
from federation.inventory.models import Instance, InstanceInterval, LanguageModel
from federation.metering import partitions
from federation.metering.cost import ZERO, InstanceHour, PoolHourCost, pool_hour_cost
from federation.metering.fleet_hours import fleet_for_hour
from federation.metering.models import (
    DIMENSIONS,
    USAGE_SUMS,
    CountedSpend,
    ModelPrice,
    PoolHour,
    StaleUsageHour,
    UsageDay,
    UsageHour,
    UsageRecord,
)
from federation.metering.pricing import FREE, PRICE_DECIMALS, Price, request_price
from federation.tenancy.models import Tenant
from regions.tables.schema import holds_for
from regions.tables.usage import UsageRecord as UsageDocument
from regions.tables.usage import UsageRecordError, decode_record

#: Statuses counted as errors in the rollups (the edge's refusals are not records at all).
ERROR_STATUS = 400


@dataclass(slots=True)
class IngestResult:
    #: Records in the batch that decoded (stored now, or already stored before).
    accepted: int = 0
    #: Documents that are not usage records, with why: kept aside by the caller, not retried.
    rejected: list[tuple[bytes, str]] = field(default_factory=list)
    #: Some record was of a tenant with a budget: the caller re-leases budgets to the edges.
    budgeted: bool = False


class PriceBook:
    """Every price row of the models in a batch, so each record is priced without a query."""

    def __init__(self, models: Iterable[str]) -> None:
        rows = ModelPrice.objects.filter(model__name__in=set(models)).select_related(
            "model", "tenant"
        )
        self._rows: dict[tuple[str, str], list[tuple[datetime, Price]]] = {}
        for row in rows.order_by("-effective_from"):
            key = (row.model.name, row.tenant.slug if row.tenant else "")
            price = Price(row.input_per_mtok, row.cached_input_per_mtok, row.output_per_mtok)
            self._rows.setdefault(key, []).append((row.effective_from, price))

    def price(self, model: str, tenant: str, at: datetime) -> Price:
        """The tenant's own price in effect at ``at``, else the list price, else free."""
        for key in ((model, tenant), (model, "")):
            for since, price in self._rows.get(key, ()):
                if since <= at:
                    return price
        return FREE


@transaction.atomic
def model_price_set(
    *,
    actor: Actor,
    model: LanguageModel,
    price: Price,
    effective_from: datetime,
    tenant: Tenant | None = None,
) -> ModelPrice:
    """Price ``model`` from ``effective_from`` on, for everyone or one ``tenant``.

    Records already ingested keep the price they were charged; a price set for a moment in the
    past applies to records ingested from now on.
    """
    amounts = {
        "input_per_mtok": price.input_per_mtok,
        "cached_input_per_mtok": price.cached_input_per_mtok,
        "output_per_mtok": price.output_per_mtok,
    }
    errors = {
        name: [f"must be >= 0 with at most {PRICE_DECIMALS} decimals"]
        for name, value in amounts.items()
        if not value.is_finite() or value < 0 or value != round(value, PRICE_DECIMALS)
    }
    if errors:
        raise ValidationError(errors)
    row, created = ModelPrice.objects.update_or_create(
        model=model, tenant=tenant, effective_from=effective_from, defaults=amounts
    )
    audit_record(
        actor=actor,
        action="model_price.set",
        obj=row,
        changes={"created": created, **{k: str(v) for k, v in amounts.items()}},
    )
    return row


def usage_ingest(
    *, documents: Sequence[bytes], region: str | None = None, edge: str | None = None
) -> IngestResult:
    """Store, priced, every record in ``documents`` not stored yet; mark their hours stale.

    One transaction: all of the batch or none of it. A document that is not a valid record
    (or, with ``region`` and ``edge``, a record of another region or edge: an edge reports
    only its own and its workers') is returned in ``rejected`` rather than raised, so it cannot
    hold the stream up.
    """
    result = IngestResult()
    records: list[UsageDocument] = []
    for document in documents:
        try:
            record = decode_record(document)
        except UsageRecordError as exc:
            result.rejected.append((document, str(exc)))
            continue
        if region is not None and record.region != region:
            result.rejected.append((document, f"a record of region {record.region!r}"))
            continue
        if edge is not None and not holds_for(edge, record.edge or ""):
            result.rejected.append((document, f"a record of edge {record.edge!r}"))
            continue
        records.append(record)
    if not records:
        return result
    started = [datetime.fromtimestamp(r.started_at, tz=UTC) for r in records]
    pools = _pools_of({r.instance for r in records})
    prices = PriceBook(r.model for r in records)
    rows = [
        _row(record, at, pools.get(record.instance, ""), prices)
        for record, at in zip(records, started, strict=True)
    ]
    with transaction.atomic():
        partitions.ensure_months({(at.year, at.month) for at in started})
        _insert(rows)
        _mark_stale({at.replace(minute=0, second=0, microsecond=0) for at in started})
    result.accepted = len(records)
    tenants = {r.tenant for r in records if r.tenant}
    result.budgeted = bool(tenants) and (
        Tenant.objects.filter(slug__in=tenants)
        .filter(Q(monthly_budget_usd__isnull=False) | Q(api_keys__monthly_budget_usd__isnull=False))
        .exists()
    )
    return result


#: Columns of a usage row, in the order :func:`_row` builds them.
COLUMNS = (
    "started_at",
    "request_id",
    "tenant",
    "key_prefix",
    "model",
    "adapter",
    "region",
    "entry_region",
    "instance",
    "pool",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "ttft_ms",
    "duration_ms",
    "status",
    "streamed",
    "cancelled",
    "usage_reported",
    "price_usd",
    "edge",
)
Row = tuple[Any, ...]


def _row(record: UsageDocument, at: datetime, pool: str, prices: PriceBook) -> Row:
    price = prices.price(record.model, record.tenant or "", at)
    return (
        at,
        record.request_id,
        record.tenant or "",
        record.key_prefix or "",
        record.model,
        record.adapter or "",
        record.region,
        record.entry_region,
        record.instance,
        pool,
        record.prompt_tokens,
        record.cached_tokens,
        record.completion_tokens,
        record.ttft_ms,
        record.duration_ms,
        record.status,
        record.streamed,
        record.cancelled,
        record.usage_reported,
        request_price(
            price,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            completion_tokens=record.completion_tokens,
        ),
        record.edge or "",
    )


def _insert(rows: list[Row]) -> None:
    """Insert the rows not stored yet and count their price (:class:`CountedSpend`).

    PostgreSQL: COPY into a temporary table, then one ``INSERT ... ON CONFLICT DO NOTHING``
    whose returned rows are summed into the counted spend by the same statement (several
    times faster than row inserts). Other databases (the demo's SQLite): row by row.
    """
    table = UsageRecord._meta.db_table
    columns = ", ".join(COLUMNS)
    with connection.cursor() as cursor:
        if connection.vendor != "postgresql":
            _insert_rows(cursor, table, columns, rows)
            return
        cursor.execute(
            f"CREATE TEMPORARY TABLE usage_in (LIKE {table} INCLUDING DEFAULTS) ON COMMIT DROP"
        )
        with cursor.cursor.copy(f"COPY usage_in ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        counted = CountedSpend._meta.db_table
        # Rows in a fixed order, so concurrent ingestions lock counted rows in the same order.
        cursor.execute(
            f"WITH stored AS (INSERT INTO {table} ({columns}) SELECT {columns} FROM usage_in "
            "ON CONFLICT DO NOTHING RETURNING started_at, tenant, key_prefix, edge, price_usd) "
            f"INSERT INTO {counted} (month, tenant, key_prefix, edge, price_usd) "
            "SELECT (date_trunc('month', started_at AT TIME ZONE 'UTC'))::date AS m, tenant, "
            "key_prefix, edge, sum(price_usd) FROM stored WHERE tenant <> '' "
            "GROUP BY m, tenant, key_prefix, edge ORDER BY m, tenant, key_prefix, edge "
            "ON CONFLICT (month, tenant, key_prefix, edge) "
            f"DO UPDATE SET price_usd = {counted}.price_usd + EXCLUDED.price_usd"
        )
        cursor.execute("DROP TABLE usage_in")  # now, not at commit: the batch may be nested


def _insert_rows(cursor: Any, table: str, columns: str, rows: list[Row]) -> None:
    marks = ", ".join(["%s"] * len(COLUMNS))
    spent: dict[tuple[date, str, str, str], Decimal] = {}
    at, tenant, key, price, edge = (
        COLUMNS.index(c) for c in ("started_at", "tenant", "key_prefix", "price_usd", "edge")
    )
    for row in rows:
        cursor.execute(
            f"INSERT INTO {table} ({columns}) VALUES ({marks}) ON CONFLICT DO NOTHING", row
        )
        if cursor.rowcount == 1 and row[tenant]:
            group = (
                row[at].astimezone(UTC).date().replace(day=1),
                row[tenant],
                row[key],
                row[edge],
            )
            spent[group] = spent.get(group, ZERO) + row[price]
    counted = CountedSpend._meta.db_table
    for (month, slug, prefix, name), usd in sorted(spent.items()):
        cursor.execute(
            f"INSERT INTO {counted} (month, tenant, key_prefix, edge, price_usd) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (month, tenant, key_prefix, edge) "
            f"DO UPDATE SET price_usd = {counted}.price_usd + EXCLUDED.price_usd",
            (month, slug, prefix, name, usd),
        )


def _pools_of(instances: set[str]) -> dict[str, str]:
    """Instance name -> ``<region>/<pool>``: of the instances that still exist, else of the
    last GPU interval of those deleted since (their records may arrive late)."""
    rows = Instance.objects.filter(name__in=instances).values_list(
        "name", "deployment__pool__region__code", "deployment__pool__name"
    )
    pools = {name: f"{region}/{pool}" for name, region, pool in rows}
    gone = instances - set(pools)
    if gone:
        last = InstanceInterval.objects.filter(name__in=gone).order_by("started_at", "id")
        pools.update(last.values_list("name", "pool"))
    return pools


def _mark_stale(hours: set[datetime]) -> None:
    now = timezone.now()
    StaleUsageHour.objects.bulk_create(
        [StaleUsageHour(hour=h, mark=uuid.uuid4(), marked_at=now) for h in sorted(hours)],
        update_conflicts=True,
        unique_fields=["hour"],
        update_fields=["mark", "marked_at"],
    )


def usage_hours_refresh(*, limit: int = 100) -> list[datetime]:
    """Recompute the rollups of up to ``limit`` stale hours, oldest first, and of their days;
    the hours done. One transaction per day, so a day's row always sums its hours."""
    stale = list(StaleUsageHour.objects.order_by("hour")[:limit])
    by_day: dict[date, list[StaleUsageHour]] = {}
    for mark in stale:
        by_day.setdefault(mark.hour.astimezone(UTC).date(), []).append(mark)
    for day, marks in by_day.items():
        with transaction.atomic():
            _serialise_rollups()
            for mark in marks:
                _recompute_hour(mark.hour)
                StaleUsageHour.objects.filter(hour=mark.hour, mark=mark.mark).delete()
            _recompute_day(day)
    return [mark.hour for mark in stale]


def _serialise_rollups() -> None:
    """One rollup transaction at a time across workers (a PostgreSQL advisory lock, released
    at commit); SQLite, the demo's database, allows one writer anyway."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext('fedinfer.usage.rollup'))")


def usage_hours_close(*, now: datetime, lookback_hours: int = 24) -> list[datetime]:
    """Mark stale the closed hours of the last ``lookback_hours`` that have no pool costs yet:
    a pool costs money in an hour nobody used it, so every hour gets its rollup."""
    last = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    hours = {last - timedelta(hours=h) for h in range(1, lookback_hours + 1)}
    done = set(PoolHour.objects.filter(hour__in=hours).values_list("hour", flat=True))
    missing = (
        hours
        - done
        - set(StaleUsageHour.objects.filter(hour__in=hours).values_list("hour", flat=True))
    )
    if missing:
        _mark_stale(missing)
    return sorted(missing)


def _recompute_day(day: date) -> None:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    sums = {f"sum_{name}": Sum(name) for name in USAGE_SUMS}
    groups = (
        UsageHour.objects.filter(hour__gte=start, hour__lt=start + timedelta(days=1))
        .values(*DIMENSIONS)
        .annotate(**sums)
    )
    UsageDay.objects.filter(day=day).delete()
    UsageDay.objects.bulk_create(
        UsageDay(
            day=day,
            **{d: g[d] for d in DIMENSIONS},
            **{name: g[f"sum_{name}"] for name in USAGE_SUMS},
        )
        for g in groups
    )


Group = tuple[str, str, str, str]  # tenant, model, region, pool


def _recompute_hour(hour: datetime) -> None:
    """The hour's rollups and pool costs from its records and the fleet as it stood then."""
    records = UsageRecord.objects.filter(
        started_at__gte=hour, started_at__lt=hour + timedelta(hours=1)
    )
    groups = records.values("tenant", "model", "region", "pool").annotate(
        n=Count("request_id"),
        n_cancelled=Count("request_id", filter=Q(cancelled=True)),
        n_errors=Count("request_id", filter=Q(status__gte=ERROR_STATUS)),
        prompt=Sum("prompt_tokens"),
        cached=Sum("cached_tokens"),
        completion=Sum("completion_tokens"),
        price=Sum("price_usd"),
    )
    pools = _pool_costs(records, hour)
    allocated: dict[Hashable, Decimal] = {}
    for cost in pools.values():
        allocated.update(cost.allocated)
    UsageHour.objects.filter(hour=hour).delete()
    UsageHour.objects.bulk_create(
        UsageHour(
            hour=hour,
            tenant=g["tenant"],
            model=g["model"],
            region=g["region"],
            pool=g["pool"],
            requests=g["n"],
            cancelled=g["n_cancelled"],
            errors=g["n_errors"],
            prompt_tokens=g["prompt"],
            cached_tokens=g["cached"],
            completion_tokens=g["completion"],
            price_usd=g["price"],
            cost_usd=allocated.get((g["tenant"], g["model"], g["region"], g["pool"]), ZERO),
        )
        for g in groups
    )
    PoolHour.objects.filter(hour=hour).delete()
    PoolHour.objects.bulk_create(
        PoolHour(
            hour=hour,
            pool=pool,
            gpus=gpus,
            cost_usd=cost.cost,
            allocated_usd=sum(cost.allocated.values(), start=ZERO),
            idle_usd=cost.idle,
            warm_idle_usd=cost.warm_idle,
            busy_s=cost.busy_s,
        )
        for (pool, gpus), cost in pools.items()
    )


def _pool_costs(
    records: QuerySet[UsageRecord], hour: datetime
) -> dict[tuple[str, int], PoolHourCost]:
    """Every pool's cost in the hour, split over the hour's usage groups, with the fleet as it
    stood in that hour (``fleet_hours.py``)."""
    usage: dict[str, dict[Hashable, tuple[int, int]]] = {}
    pools: set[str] = set()
    for row in records.values("instance", "tenant", "model", "region", "pool").annotate(
        fresh=Sum(F("prompt_tokens") - F("cached_tokens")), generated=Sum("completion_tokens")
    ):
        group: Group = (row["tenant"], row["model"], row["region"], row["pool"])
        usage.setdefault(row["instance"], {})[group] = (row["fresh"], row["generated"])
        pools.add(row["pool"])
    fleet = fleet_for_hour(hour, usage, now=timezone.now(), served_pools=pools)
    by_pool: dict[str, list[InstanceHour]] = {}
    for inst in fleet.instances:
        by_pool.setdefault(inst.pool, []).append(
            InstanceHour(
                instance=inst.instance,
                gpus=inst.gpus,
                prefill_tokens_per_s=inst.prefill_tokens_per_s,
                decode_tokens_per_s=inst.decode_tokens_per_s,
                usage=usage.get(inst.instance, {}),
                held_s=inst.held_s,
            )
        )
    return {
        (pool.pool, pool.gpus): pool_hour_cost(
            spans=pool.spans, instances=by_pool.get(pool.pool, [])
        )
        for pool in fleet.pools
    }
