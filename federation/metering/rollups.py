"""Keep the hourly and daily usage rollups exact, and every pool's cost per hour.

Rollups are recomputed per hour from the records, never incremented, so they cannot drift
from what the records say: ingestion marks an hour stale (:func:`usage_hours_mark_stale`), a
worker recomputes it and its day (:func:`usage_hours_refresh`), and every closed hour gets
its pool costs even when nobody used the pool (:func:`usage_hours_close`).
"""

from __future__ import annotations

import uuid
from collections.abc import Hashable, Iterable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.db import connection, transaction
from django.db.models import Count, F, Q, QuerySet, Sum
from django.utils import timezone

from federation.metering.cost import (
    ZERO,
    InstanceHour,
    PoolHourCost,
    pool_hour_cost,
    reprefill_by_instance,
)
from federation.metering.fleet_hours import fleet_for_hour
from federation.metering.models import (
    DIMENSIONS,
    USAGE_SUMS,
    PoolHour,
    StaleUsageHour,
    UsageDay,
    UsageHour,
    UsageRecord,
)

#: Statuses counted as errors in the rollups (the edge's refusals are not records at all).
ERROR_STATUS = 400


def usage_hours_mark_stale(times: Iterable[datetime]) -> None:
    """Have the rollups of the hours holding these times recomputed (``usage_hours_refresh``)."""
    hours = {at.replace(minute=0, second=0, microsecond=0) for at in times}
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
        usage_hours_mark_stale(missing)
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
            reprefill_usd=cost.reprefill,
            busy_s=cost.busy_s,
        )
        for (pool, gpus), cost in pools.items()
    )


def _pool_costs(
    records: QuerySet[UsageRecord], hour: datetime
) -> dict[tuple[str, int], PoolHourCost]:
    """Every pool's cost in the hour, split over the hour's usage groups and the re-prefills of
    continued streams (the operator's), with the fleet as it stood in that hour
    (``fleet_hours.py``)."""
    usage: dict[str, dict[Hashable, tuple[int, int]]] = {}
    pools: set[str] = set()
    for row in records.values("instance", "tenant", "model", "region", "pool").annotate(
        fresh=Sum(F("prompt_tokens") - F("cached_tokens")), generated=Sum("completion_tokens")
    ):
        group: Group = (row["tenant"], row["model"], row["region"], row["pool"])
        usage.setdefault(row["instance"], {})[group] = (row["fresh"], row["generated"])
        pools.add(row["pool"])
    fleet = fleet_for_hour(hour, usage, now=timezone.now(), served_pools=pools)
    reprefill = _reprefill_by_instance(records, {i.instance for i in fleet.instances})
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
                reprefill_tokens=reprefill.get(inst.instance, 0),
            )
        )
    return {
        (pool.pool, pool.gpus): pool_hour_cost(
            spans=pool.spans, instances=by_pool.get(pool.pool, [])
        )
        for pool in fleet.pools
    }


def _reprefill_by_instance(records: QuerySet[UsageRecord], known: set[str]) -> dict[str, int]:
    """Per instance of the hour's fleet, the prompt tokens continued streams had it process
    again (the operator's work): on their legs' instances (``cost.reprefill_by_instance``), or
    on the record's instance for a leg the fleet does not know (another edge's instance it
    could not name)."""
    reprefill: dict[str, int] = {}
    continued = (
        records.filter(reprefill_tokens__gt=0)
        .values("instance", "legs")
        .annotate(tokens=Sum("reprefill_tokens"))
    )
    for row in continued:
        for name, tokens in reprefill_by_instance(
            row["instance"], row["legs"], row["tokens"]
        ).items():
            where = name if name in known else row["instance"]
            reprefill[where] = reprefill.get(where, 0) + tokens
    return reprefill
