"""A month of usage history for the demo (``fedinfer demo --usage-days N``): what the reports,
cost attribution and budgets have to show before the demo has served much itself.

Seeded and plain: for every hour, each active tenant sends requests to the ready instances of
the regions its residency policy permits, more in that region's daytime than at night, most to
the small model; prompts, cache hits and answers vary the way chat traffic does. The records
are the edges' own documents (``regions/tables/usage.py``), ingested like any other.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from federation.inventory.models import Instance, PoolRevision
from federation.metering import rollups
from federation.metering import services as metering
from federation.tenancy.models import Tenant
from federation.tenancy.selectors import region_refs, tenant_permitted_regions
from regions.tables.usage import UsageRecord, encode_record

#: Requests per tenant and hour at the busiest time of a region's day.
PEAK_REQUESTS_PER_HOUR = 24


@dataclass(frozen=True, slots=True)
class Target:
    instance: str
    region: str
    model: str
    longitude: float
    #: Smaller models get more of the traffic.
    weight: float


def _targets() -> dict[str, list[Target]]:
    """Region code -> the ready instances there."""
    rows = Instance.objects.filter(state="ready").select_related(
        "deployment__model", "deployment__pool__region"
    )
    out: dict[str, list[Target]] = {}
    for inst in rows.order_by("name"):
        dep = inst.deployment
        region = dep.pool.region
        weight = 8.0 / max(float(dep.model.parameter_count_b), 1.0)
        target = Target(inst.name, region.code, dep.model.name, region.longitude, weight)
        out.setdefault(region.code, []).append(target)
    return out


def _daytime(hour: datetime, longitude: float) -> float:
    """0.2 at night to 1.0 in the early afternoon, local solar time."""
    local = (hour.hour + longitude / 15.0) % 24
    return 0.2 + 0.8 * max(0.0, math.sin(math.pi * (local - 7) / 14))


def history_start(*, days: int, now: datetime) -> datetime:
    """The first hour of :func:`usage_history`."""
    return now.astimezone(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(days=days)


def date_pools_back(since: datetime) -> None:
    """The pools made for the demo have been there since ``since``: their first revisions are
    moved back to it, so the history's hours are costed with the whole fleet, idle pools
    included (``metering/fleet_hours.py``), as a fleet that really ran then would be."""
    firsts: dict[str, PoolRevision] = {}
    for rev in PoolRevision.objects.order_by("pool", "effective_from", "id"):
        firsts.setdefault(rev.pool, rev)
    PoolRevision.objects.filter(
        pk__in=[r.pk for r in firsts.values() if r.effective_from > since]
    ).update(effective_from=since)


def usage_history(*, days: int, now: datetime, seed: int = 7) -> Iterator[bytes]:
    """Usage records of the ``days`` whole hours before ``now``, oldest first (see
    :func:`date_pools_back` for the pools they are costed on)."""
    rand = random.Random(seed)
    targets = _targets()
    refs = region_refs()
    tenants = [
        (t.slug, [r for r in tenant_permitted_regions(t, refs) if r in targets])
        for t in Tenant.objects.filter(is_active=True).order_by("slug")
    ]
    last = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    n = 0
    for h in range(days * 24, 0, -1):
        hour = last - timedelta(hours=h)
        for slug, regions in tenants:
            for region in regions:
                choices = targets[region]
                rate = PEAK_REQUESTS_PER_HOUR * _daytime(hour, choices[0].longitude)
                for _ in range(rand.randint(0, round(rate / len(regions)) * 2)):
                    n += 1
                    target = rand.choices(choices, weights=[c.weight for c in choices])[0]
                    yield encode_record(_record(rand, n, seed, hour, slug, target))


def _record(
    rand: random.Random, n: int, seed: int, hour: datetime, tenant: str, target: Target
) -> UsageRecord:
    prompt = int(rand.lognormvariate(6.5, 0.8))  # ~700 tokens, a long tail
    cached = min(prompt, int(prompt * rand.choice((0.0, 0.0, 0.5, 0.8, 0.9))))
    completion = int(rand.lognormvariate(5.0, 0.7))  # ~150 tokens
    ttft = 80.0 + (prompt - cached) / 20.0
    return UsageRecord(
        request_id=f"history-{seed}-{n}",
        started_at=(hour + timedelta(seconds=rand.uniform(0, 3599))).timestamp(),
        region=target.region,
        entry_region=target.region,
        instance=target.instance,
        model=target.model,
        tenant=tenant,
        key_prefix="fi_history",
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        ttft_ms=ttft,
        duration_ms=ttft + completion * 15.0,
        streamed=rand.random() < 0.5,
    )


def load_usage_history(*, days: int, now: datetime, batch: int = 5_000) -> int:
    """Generate :func:`usage_history` on a fleet dated back to its start, ingest it and roll
    it up, as the worker would; the number of records."""
    date_pools_back(history_start(days=days, now=now))
    records = list(usage_history(days=days, now=now))
    for i in range(0, len(records), batch):
        metering.usage_ingest(documents=records[i : i + batch])
    while rollups.usage_hours_refresh(limit=200):
        pass
    return len(records)
