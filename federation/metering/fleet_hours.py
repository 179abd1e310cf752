"""The fleet an hour's cost is computed over: as it is now while the hour runs, frozen once the
hour has ended (``FleetHour``).

Costs depend on the inventory — pool sizes and prices, which instances held GPUs, their speeds —
which changes. Computing an old hour again with today's inventory would move money between
hours and tenants after the statements went out. So the first rollup of an hour after its end
takes the facts and stores them with the hour; every later rollup of that hour uses them. An
instance that served records of the hour but was not in the facts (it stopped before the hour
ended) is added with its facts as they are, then frozen too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.db.models import Q

from federation.inventory.models import GPUPool, Instance
from federation.inventory.speed import decode_tokens_per_s, prefill_tokens_per_s
from federation.metering.models import FleetHour

#: Instance states that hold their GPUs (a stopped or failed instance has released them).
HOLDING_GPUS = ("loading", "warming", "ready", "draining")


@dataclass(frozen=True, slots=True)
class PoolFacts:
    pool: str  # "<region>/<pool>", as in UsageRecord.pool
    gpus: int
    price_per_gpu_hour: Decimal


@dataclass(frozen=True, slots=True)
class InstanceFacts:
    instance: str
    pool: str
    gpus: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Fleet:
    pools: list[PoolFacts]
    instances: list[InstanceFacts]


def fleet_for_hour(hour: datetime, served_by: Iterable[str], *, now: datetime) -> Fleet:
    """The facts to cost ``hour`` with; ``served_by``: the instances in its records."""
    served = set(served_by)
    if hour + timedelta(hours=1) > now:  # still running: nothing to freeze yet
        return _fleet_now(served)
    frozen = FleetHour.objects.filter(hour=hour).first()
    if frozen is None:
        fleet = _fleet_now(served)
        FleetHour.objects.create(hour=hour, taken_at=now, **_document(fleet))
        return fleet
    fleet = _decode(frozen)
    missing = served - {i.instance for i in fleet.instances}
    if missing:
        added = _instances_now(Q(name__in=missing))
        fleet = Fleet(fleet.pools, fleet.instances + added)
        FleetHour.objects.filter(pk=frozen.pk).update(**_document(fleet))
    return fleet


def _fleet_now(served: set[str]) -> Fleet:
    pools = [
        PoolFacts(f"{p.region.code}/{p.name}", p.total_gpus, p.price_per_gpu_hour)
        for p in GPUPool.objects.select_related("region").order_by("region__code", "name")
    ]
    return Fleet(pools, _instances_now(Q(state__in=HOLDING_GPUS) | Q(name__in=served)))


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
            {**asdict(p), "price_per_gpu_hour": str(p.price_per_gpu_hour)} for p in fleet.pools
        ],
        "instances": [asdict(i) for i in fleet.instances],
    }


def _decode(frozen: FleetHour) -> Fleet:
    return Fleet(
        pools=[
            PoolFacts(p["pool"], int(p["gpus"]), Decimal(p["price_per_gpu_hour"]))
            for p in frozen.pools
        ],
        instances=[InstanceFacts(**i) for i in frozen.instances],
    )
