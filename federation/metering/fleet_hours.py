"""The fleet an hour's cost is computed over: from the instances' GPU intervals while the hour
runs or until it is frozen, frozen once the hour has ended (``FleetHour``).

Costs depend on the inventory — pool sizes and prices, which instances held GPUs and for how
long, their speeds — which changes. Every instance's GPU-holding stretches are recorded as
they happen (``InstanceInterval``, written by the lifecycle service), so an hour's instances
are those whose intervals overlap it, each for the seconds of the hour it held its GPUs: an
instance stopped ten minutes into an hour counts for ten minutes, whenever the hour is
computed. Pools likewise: each change of a pool's size or price is a revision
(``PoolRevision``), so a pool resized or repriced within an hour costs each part of the hour
at what it had then. The first rollup of an hour after its end stores those facts with the
hour; every later rollup of that hour uses them. An instance that served records of the hour
but has no interval overlapping it (one started before intervals were recorded, or a record
stamped by a skewed clock) is added for the whole hour with its last interval's facts, or the
inventory's, then frozen too; a pool that served records of an hour before its first revision
(history loaded after the fact) is costed for the whole hour with that revision's facts, and a
pool with no revision at all (made outside the services) as it is now.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta
from decimal import Decimal

from django.db.models import Q

from federation.inventory.models import GPUPool, Instance, InstanceInterval, PoolRevision
from federation.inventory.speed import decode_tokens_per_s, prefill_tokens_per_s
from federation.metering.cost import HOUR_S, PoolSpan, whole_hour
from federation.metering.models import FleetHour


@dataclass(frozen=True, slots=True)
class PoolFacts:
    pool: str  # "<region>/<pool>", as in UsageRecord.pool
    #: Its GPUs and price over the hour, in order.
    spans: tuple[PoolSpan, ...]

    @property
    def gpus(self) -> int:
        """The most GPUs it had in the hour (what reports show)."""
        return max((s.gpus for s in self.spans), default=0)


@dataclass(frozen=True, slots=True)
class InstanceFacts:
    instance: str
    pool: str
    gpus: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    #: Seconds of the hour it held its GPUs (hours frozen before intervals: all of it).
    held_s: float = HOUR_S


@dataclass(frozen=True, slots=True)
class Fleet:
    pools: list[PoolFacts]
    instances: list[InstanceFacts]


def fleet_for_hour(
    hour: datetime, served_by: Iterable[str], *, now: datetime, served_pools: Iterable[str] = ()
) -> Fleet:
    """The facts to cost ``hour`` with; ``served_by``: the instances in its records,
    ``served_pools``: their pools."""
    served = set(served_by)
    if hour + timedelta(hours=1) > now:  # still running: nothing to freeze yet
        return _fleet_of(hour, served, set(served_pools))
    frozen = FleetHour.objects.filter(hour=hour).first()
    if frozen is None:
        fleet = _fleet_of(hour, served, set(served_pools))
        FleetHour.objects.create(hour=hour, taken_at=now, **_document(fleet))
        return fleet
    fleet = _decode(frozen)
    missing = served - {i.instance for i in fleet.instances}
    unpriced = set(served_pools) - {p.pool for p in fleet.pools}
    if missing or unpriced:
        pools = fleet.pools + (_pools_in(hour, unpriced, only=unpriced) if unpriced else [])
        fleet = Fleet(pools, fleet.instances + (_whole_hour(missing) if missing else []))
        FleetHour.objects.filter(pk=frozen.pk).update(**_document(fleet))
    return fleet


def _fleet_of(hour: datetime, served: set[str], served_pools: set[str]) -> Fleet:
    """The pools as they were during ``hour``; the instances whose intervals overlap it, and
    those that served it without one."""
    instances = _held_in(hour)
    missing = served - {i.instance for i in instances}
    return Fleet(
        _pools_in(hour, served_pools),
        instances + _whole_hour(missing) if missing else instances,
    )


def _pools_in(hour: datetime, served: set[str], only: set[str] | None = None) -> list[PoolFacts]:
    """Every pool's spans in ``hour`` from its revisions (``only``: just these pools)."""
    end = hour + timedelta(hours=1)
    revisions: dict[str, list[PoolRevision]] = {}
    found = (
        PoolRevision.objects.all() if only is None else PoolRevision.objects.filter(pool__in=only)
    )
    for rev in found.order_by("pool", "effective_from", "id"):
        revisions.setdefault(rev.pool, []).append(rev)
    out = [
        PoolFacts(key, spans)
        for key, revs in revisions.items()
        if (spans := _pool_spans(revs, hour, end, served=key in served))
    ]
    # A pool made outside the services has no revision: costed as it is now.
    for pool in GPUPool.objects.select_related("region"):
        key = f"{pool.region.code}/{pool.name}"
        if key not in revisions and (only is None or key in only):
            out.append(PoolFacts(key, whole_hour(pool.total_gpus, pool.price_per_gpu_hour)))
    return sorted(out, key=lambda p: p.pool)


def _pool_spans(
    revisions: list[PoolRevision], hour: datetime, end: datetime, *, served: bool
) -> tuple[PoolSpan, ...]:
    """One pool's stretches of ``[hour, end)`` from its revisions (in order): each revision
    holds until the next. Before the first, the pool did not exist — unless it served records
    of the hour (history loaded after the fact): then the first holds from the hour's start."""
    spans = []
    for n, rev in enumerate(revisions):
        start = hour if (n == 0 and served) else max(rev.effective_from, hour)
        stop = min(revisions[n + 1].effective_from, end) if n + 1 < len(revisions) else end
        if stop > start and rev.gpus:
            spans.append(PoolSpan(rev.gpus, rev.price_per_gpu_hour, (stop - start).total_seconds()))
    return tuple(spans)


def _held_in(hour: datetime) -> list[InstanceFacts]:
    """Each instance's seconds of ``hour`` holding GPUs, from its intervals (an open one runs
    to the end of the hour)."""
    end = hour + timedelta(hours=1)
    held: dict[str, float] = {}
    facts: dict[str, InstanceFacts] = {}
    for row in InstanceInterval.objects.filter(started_at__lt=end).filter(
        Q(ended_at__isnull=True) | Q(ended_at__gt=hour)
    ):
        seconds = (min(row.ended_at or end, end) - max(row.started_at, hour)).total_seconds()
        held[row.name] = held.get(row.name, 0.0) + seconds
        facts[row.name] = _facts_of(row)
    return [replace(facts[name], held_s=held[name]) for name in sorted(facts)]


def _whole_hour(names: set[str]) -> list[InstanceFacts]:
    """Facts of instances known to have served an hour but not when they held GPUs: their
    last interval's, else the inventory's now; for the whole hour."""
    found: dict[str, InstanceFacts] = {}
    for row in InstanceInterval.objects.filter(name__in=names).order_by("started_at", "id"):
        found[row.name] = _facts_of(row)
    rest = names - set(found)
    now = _instances_now(Q(name__in=rest)) if rest else []
    return sorted([*found.values(), *now], key=lambda f: f.instance)


def _facts_of(row: InstanceInterval) -> InstanceFacts:
    return InstanceFacts(
        instance=row.name,
        pool=row.pool,
        gpus=row.gpus,
        prefill_tokens_per_s=row.prefill_tokens_per_s,
        decode_tokens_per_s=row.decode_tokens_per_s,
    )


def _instances_now(which: Q) -> list[InstanceFacts]:
    facts = []
    for inst in (
        Instance.objects.filter(which)
        .select_related("deployment__pool__region", "deployment__pool__accelerator")
        .select_related("deployment__model")
        .order_by("name")
    ):
        dep = inst.deployment
        speed = dep.pool.accelerator.relative_speed
        tp = dep.tensor_parallel_size
        params_b = float(dep.model.parameter_count_b)
        facts.append(
            InstanceFacts(
                instance=inst.name,
                pool=f"{dep.pool.region.code}/{dep.pool.name}",
                gpus=tp,
                prefill_tokens_per_s=prefill_tokens_per_s(
                    relative_speed=speed, tensor_parallel_size=tp, params_b=params_b
                ),
                decode_tokens_per_s=decode_tokens_per_s(
                    relative_speed=speed, tensor_parallel_size=tp, params_b=params_b
                ),
            )
        )
    return facts


def _document(fleet: Fleet) -> dict[str, list[dict[str, object]]]:
    return {
        "pools": [
            {
                "pool": p.pool,
                "spans": [[s.gpus, str(s.price_per_gpu_hour), s.seconds] for s in p.spans],
            }
            for p in fleet.pools
        ],
        "instances": [asdict(i) for i in fleet.instances],
    }


def _decode(frozen: FleetHour) -> Fleet:
    """A frozen hour; one frozen before pool revisions has a size and price per pool."""
    return Fleet(
        pools=[
            PoolFacts(
                p["pool"],
                tuple(PoolSpan(int(g), Decimal(price), float(s)) for g, price, s in p["spans"])
                if "spans" in p
                else whole_hour(int(p["gpus"]), Decimal(p["price_per_gpu_hour"])),
            )
            for p in frozen.pools
        ],
        instances=[InstanceFacts(**i) for i in frozen.instances],
    )
