"""The overview's figures, computed from rows already loaded: no queries here.

Load is read the way the routing compiler reads it: tokens per second from the edges'
heartbeats (``Instance.load``) against what the ready replicas sustain at full load
(``federation.inventory.speed``). The compiler plans capacity at
``TARGET_UTILISATION``; the console shows a region inside, under or over the 60-70 % band
around it. TTFT percentiles and spill-over come from the latest metered requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from console.progress import Progress, ramp_progress
from federation.inventory import lifecycle
from federation.inventory.speed import replica_tokens_per_s
from federation.routing.compiler import ROLE_CAPACITY_SHARE
from federation.routing.ramp import ramp_level, ramp_next_change_s
from federation.routing.selectors import reported_health
from federation.routing.snapshot import RampPolicy

#: The band around the compiler's target that the overview calls "on target".
TARGET_LOW = 0.60
TARGET_HIGH = 0.70


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """One instance as the overview needs it."""

    name: str
    region: str
    pool: str
    model: str
    state: str
    capacity_tokens_per_s: float
    tokens_per_s: float | None
    in_flight: int | None
    healthy: bool | None


@dataclass(frozen=True, slots=True)
class EdgeRow:
    name: str
    applied_version: int | None
    last_heartbeat_at: datetime | None
    current: bool


@dataclass(frozen=True, slots=True)
class Traffic:
    """One recent metered request: where it entered, where it was served, its TTFT."""

    entry_region: str
    region: str
    ttft_ms: float | None
    status: int


@dataclass(slots=True)
class RegionCard:
    code: str
    name: str
    jurisdiction: str
    status: str
    latest_version: int | None
    instances: int = 0
    ready: int = 0
    unhealthy: int = 0
    tokens_per_s: float = 0.0
    capacity_tokens_per_s: float = 0.0
    requests: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    edges: list[EdgeRow] = field(default_factory=list)
    #: Requests that entered here and were served elsewhere, by serving region.
    spill_out: dict[str, int] = field(default_factory=dict)
    #: Share of its traffic it gets back after a restore or recovery (1: not ramping), and
    #: seconds until the next step.
    ramp: float = 1.0
    ramp_next_s: float | None = None
    #: The ramp against its schedule, while there is one.
    ramp_progress: Progress | None = None

    @property
    def utilisation(self) -> float | None:
        if self.capacity_tokens_per_s <= 0:
            return None
        return self.tokens_per_s / self.capacity_tokens_per_s

    @property
    def band(self) -> str:
        """'idle', 'under', 'target', 'over' or 'unknown' against the 60-70 % band."""
        u = self.utilisation
        if u is None:
            return "unknown"
        if u == 0:
            return "idle"
        if u < TARGET_LOW:
            return "under"
        return "target" if u <= TARGET_HIGH else "over"


def instance_capacity(
    *, relative_speed: float, tensor_parallel_size: int, params_b: float, role: str
) -> float:
    """Tokens/s one replica sustains at full load (a disaggregated half counts half)."""
    return replica_tokens_per_s(
        relative_speed=relative_speed, tensor_parallel_size=tensor_parallel_size, params_b=params_b
    ) * ROLE_CAPACITY_SHARE.get(role, 1.0)


def _number(load: Any, key: str) -> float | None:
    value = load.get(key) if isinstance(load, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return float(value)


def instance_load(inst: Any, now: datetime) -> InstanceLoad:
    """An ``Instance`` loaded with its deployment, model, pool, region and accelerator."""
    dep = inst.deployment
    in_flight = _number(inst.load, "in_flight")
    return InstanceLoad(
        name=inst.name,
        region=dep.pool.region.code,
        pool=dep.pool.name,
        model=dep.model.name,
        state=inst.state,
        capacity_tokens_per_s=instance_capacity(
            relative_speed=dep.pool.accelerator.relative_speed,
            tensor_parallel_size=dep.tensor_parallel_size,
            params_b=float(dep.model.parameter_count_b),
            role=dep.role,
        ),
        tokens_per_s=_number(inst.load, "tokens_per_s"),
        in_flight=None if in_flight is None else int(in_flight),
        healthy=reported_health(inst.load, now),
    )


def percentile(values: Sequence[float], share: float) -> float | None:
    """Nearest-rank percentile of sorted ``values`` (None for none)."""
    if not values:
        return None
    rank = max(1, min(len(values), math.ceil(share * len(values))))
    return values[rank - 1]


def region_cards(
    regions: Iterable[Any],
    loads: Iterable[InstanceLoad],
    traffic: Iterable[Traffic],
    *,
    now: datetime | None = None,
    ramp: RampPolicy | None = None,
) -> list[RegionCard]:
    """One card per region (``routing_table_overview`` rows: latest version, edges); with
    ``now`` and the ``ramp`` policy, where a returning region's ramp stands (the compiler's
    steps, from the later of its restore and its recovery)."""
    cards: dict[str, RegionCard] = {}
    for r in regions:
        latest = r.latest_version
        cards[r.code] = RegionCard(
            code=r.code,
            name=r.name,
            jurisdiction=r.jurisdiction,
            status=r.status,
            latest_version=latest,
            edges=[
                EdgeRow(
                    e.name,
                    e.applied_table_version,
                    e.last_heartbeat_at,
                    latest is not None and e.applied_table_version == latest,
                )
                for e in r.edges.all()
            ],
        )
        starts = [t for t in (r.restored_at, r.recovered_at) if t is not None]
        if now is not None and ramp is not None and starts and r.status != "evacuated":
            elapsed = (now - max(starts)).total_seconds()
            cards[r.code].ramp = ramp_level(elapsed, ramp)
            cards[r.code].ramp_next_s = ramp_next_change_s(elapsed, ramp)
            cards[r.code].ramp_progress = ramp_progress(
                status=r.status,
                restored_at=r.restored_at,
                recovered_at=r.recovered_at,
                now=now,
                policy=ramp,
            )
    for load in loads:
        card = cards.get(load.region)
        if card is None or load.state in lifecycle.TERMINAL_STATES:
            continue
        card.instances += 1
        if load.state != lifecycle.READY:
            continue
        card.ready += 1
        card.unhealthy += load.healthy is False
        card.capacity_tokens_per_s += load.capacity_tokens_per_s
        card.tokens_per_s += load.tokens_per_s or 0.0
    ttfts: dict[str, list[float]] = {}
    spills: dict[str, Counter[str]] = {}
    for t in traffic:
        if t.status >= 400:
            continue
        if t.region in cards:
            cards[t.region].requests += 1
            if t.ttft_ms is not None:
                ttfts.setdefault(t.region, []).append(t.ttft_ms)
        if t.entry_region != t.region:
            spills.setdefault(t.entry_region, Counter())[t.region] += 1
    for code, card in cards.items():
        values = sorted(ttfts.get(code, ()))
        card.ttft_p50_ms = percentile(values, 0.50)
        card.ttft_p99_ms = percentile(values, 0.99)
        card.spill_out = dict(sorted(spills.get(code, Counter()).items()))
    return list(cards.values())


#: An edge whose last heartbeat is older than this is reported (it sends one every few seconds).
EDGE_SILENT_S = 60.0


def alerts(cards: Iterable[RegionCard], now: datetime) -> list[str]:
    """What needs an operator's eye: unhealthy instances, load over the band, silent edges
    and edges behind their region's latest table."""
    found = []
    for c in cards:
        if c.unhealthy:
            found.append(f"{c.code}: {c.unhealthy} ready instance(s) reported unhealthy")
        if c.band == "over":
            found.append(f"{c.code}: load {c.utilisation:.0%} is over the {TARGET_HIGH:.0%} band")
        for e in c.edges:
            silent = e.last_heartbeat_at is None or (
                (now - e.last_heartbeat_at).total_seconds() > EDGE_SILENT_S
            )
            if silent:
                found.append(f"{c.code}: edge {e.name} has not sent a heartbeat for a minute")
            elif not e.current:
                found.append(
                    f"{c.code}: edge {e.name} runs table v{e.applied_version}, "
                    f"latest is v{c.latest_version}"
                )
    return found
