"""What serving cost the operator: a GPU pool's hour split over the usage it served. Pure, exact.

The rule (``docs/metering.md``):

1. A pool's hour costs its GPUs x its price per GPU-hour, busy or not; a pool resized or
   repriced within the hour costs each stretch of it at what it had then (:class:`PoolSpan`).
2. That cost is split over the pool's instances by their GPU-seconds in the hour (tensor-
   parallel size x the seconds of the hour they held their GPUs); the pool's GPU-seconds no
   instance held are *idle*, their share is unallocated. (Instances that overlapped while one
   replaced another may add up to more than the pool has: then they share all of it, nothing
   idle.)
3. An instance's share is split over the usage it served in the hour by *engine time*: each
   fresh (uncached) prompt token costs 1/prefill-rate seconds, each generated token
   1/decode-rate seconds, at the instance's speed. Warm but idle time is part of the instance's
   cost, so its users carry it in proportion to their engine time ("full absorption"): a
   replica kept warm is kept warm for the tenants that use it. An instance that served nothing
   in the hour is *warm idle*, unallocated.
4. A stream continued on another instance after its engine was lost (issue 31) is billed
   once, on its prompt and the completion the client received; the prompt and relayed text
   the engines processed again to continue it (``reprefill_tokens``, prefill at the instance's
   rate, on the instances that continued it: :func:`reprefill_by_instance`) is engine time of
   the operator's, not any tenant's: it takes its share of the instance's cost like a group
   of usage (so it also carries its part of the warm time), and that share is unallocated as
   *reprefill* — the tenant pays neither the re-prefill's price nor its cost.

Every split is exact to 1e-12 USD (largest remainder), so for each pool and hour
``allocated + unallocated == cost`` to the last digit (unallocated: idle + warm idle +
reprefill), and so for any grouping of the result.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_DOWN, Decimal
from enum import Enum
from typing import TypeVar

QUANTUM = Decimal("1e-12")
HOUR_S = 3600.0
#: The part of a pool's GPUs no instance uses (instance names are never empty).
_IDLE = ""
ZERO = Decimal(0)
K = TypeVar("K", bound=Hashable)


class _Operator(Enum):
    """An instance's work no tenant carries (a key no usage group can be, with a stable
    ``repr`` for :func:`split_exactly`'s ties)."""

    REPREFILL = "reprefill"


def reprefill_by_instance(instance: str, legs: str, tokens: int) -> dict[str, int]:
    """Where a continued stream's ``tokens`` of re-prefill ran: on the instances of its legs
    after the first (``region/instance,…``: each continuation prefilled the prompt and the
    answer so far there), split evenly — the record has no count per leg — the units left over
    on the last legs; on the record's ``instance`` when its legs name no other."""
    names = [leg.split("/", 1)[1] for leg in legs.split(",")[1:] if "/" in leg]
    if not names or tokens <= 0:
        return {instance: tokens} if tokens > 0 else {}
    share, left = divmod(tokens, len(names))
    where: dict[str, int] = {}
    for n, name in enumerate(names):
        where[name] = where.get(name, 0) + share + (1 if n >= len(names) - left else 0)
    return where


def split_exactly(amount: Decimal, weights: Mapping[K, float]) -> dict[K, Decimal]:
    """``amount`` split in proportion to ``weights`` (all > 0), each share a multiple of
    :data:`QUANTUM`, summing to ``amount`` exactly: shares are rounded down, then the units
    left over go one each to the largest remainders (ties in key order, so it is
    deterministic)."""
    if amount != amount.quantize(QUANTUM):
        raise ValueError(f"{amount} has more decimals than {QUANTUM}")
    if not weights:
        raise ValueError("nothing to split over")
    if min(weights.values()) <= 0:
        raise ValueError("weights must be > 0")
    total = sum(Decimal(w) for w in weights.values())
    exact = {k: amount * Decimal(w) / total for k, w in weights.items()}
    shares = {k: v.quantize(QUANTUM, rounding=ROUND_DOWN) for k, v in exact.items()}
    left = int((amount - sum(shares.values(), start=ZERO)) / QUANTUM)
    by_remainder = sorted(exact, key=lambda k: (shares[k] - exact[k], repr(k)))
    for k in by_remainder[:left]:
        shares[k] += QUANTUM
    return shares


@dataclass(frozen=True, slots=True)
class PoolSpan:
    """A stretch of the hour in which the pool had ``gpus`` GPUs at one price."""

    gpus: int
    price_per_gpu_hour: Decimal
    seconds: float = HOUR_S


def whole_hour(gpus: int, price_per_gpu_hour: Decimal) -> tuple[PoolSpan]:
    """A pool unchanged through the hour."""
    return (PoolSpan(gpus, price_per_gpu_hour),)


@dataclass(frozen=True, slots=True)
class InstanceHour:
    """One instance of the pool in the hour: its GPUs, speeds, and what each group of usage
    (e.g. tenant x model) asked of it, as (fresh prompt tokens, generated tokens)."""

    instance: str
    gpus: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    usage: Mapping[Hashable, tuple[int, int]] = field(default_factory=dict)
    #: Seconds of the hour it held its GPUs.
    held_s: float = HOUR_S
    #: Prompt tokens it processed again to continue streams another instance lost (the
    #: operator's work, in no group's usage).
    reprefill_tokens: int = 0

    def engine_seconds(self) -> dict[Hashable, float]:
        """Engine time per group; groups that cost no engine time are left out."""
        seconds = {
            group: fresh / self.prefill_tokens_per_s + generated / self.decode_tokens_per_s
            for group, (fresh, generated) in self.usage.items()
        }
        return {group: s for group, s in seconds.items() if s > 0}

    def reprefill_seconds(self) -> float:
        """Engine time of its re-prefills (prefill at its speed)."""
        return self.reprefill_tokens / self.prefill_tokens_per_s


@dataclass(slots=True)
class PoolHourCost:
    cost: Decimal
    #: Group -> its share of the pool's cost.
    allocated: dict[Hashable, Decimal]
    #: GPUs with no instance.
    idle: Decimal = ZERO
    #: Instances that served nothing in the hour.
    warm_idle: Decimal = ZERO
    #: The instances' share for continued streams' re-prefills: the operator's.
    reprefill: Decimal = ZERO
    #: Engine seconds of the hour's usage and re-prefills, over all instances.
    busy_s: float = 0.0

    @property
    def unallocated(self) -> Decimal:
        return self.idle + self.warm_idle + self.reprefill


def pool_hour_cost(*, spans: Sequence[PoolSpan], instances: Sequence[InstanceHour]) -> PoolHourCost:
    """Split one pool's hour (see the module's rule); ``spans``: its GPUs and price over the
    hour (no span: it did not exist)."""
    cost = sum(
        (s.gpus * s.price_per_gpu_hour * Decimal(s.seconds) / Decimal(HOUR_S) for s in spans),
        start=ZERO,
    ).quantize(QUANTUM)
    capacity_s = sum(s.gpus * s.seconds for s in spans)
    result = PoolHourCost(cost=cost, allocated={})
    if cost == 0 or capacity_s == 0:
        return result
    parts: dict[Hashable, float] = {
        i.instance: i.gpus * i.held_s for i in instances if i.gpus and i.held_s > 0
    }
    used = sum(parts.values())
    if capacity_s > used:
        parts[_IDLE] = capacity_s - used
    shares = split_exactly(cost, parts)
    result.idle = shares.pop(_IDLE, ZERO)
    for inst in instances:
        seconds = inst.engine_seconds()
        reprefill_s = inst.reprefill_seconds()
        if reprefill_s > 0:
            seconds[_Operator.REPREFILL] = reprefill_s
        share = shares.get(inst.instance, ZERO)
        if not seconds:
            result.warm_idle += share
            continue
        result.busy_s += sum(seconds.values())
        split = split_exactly(share, seconds)
        result.reprefill += split.pop(_Operator.REPREFILL, ZERO)
        for group, amount in split.items():
            result.allocated[group] = result.allocated.get(group, ZERO) + amount
    return result
