"""The placement planner's inputs and outputs: the pools, models, demand and running deployments
it is given (``PlacementInput``, ``PlannerPolicy``), the plan it returns (``Plan``) and the
reasons demand goes unserved. Pure, no Django: dataclasses only.

A module of its own so that the I/O shells (``placement_inputs`` builds a ``PlacementInput``
from the database, ``placing`` keeps and applies a ``Plan``) and the programme
(``placement_milp``) share the types without the solver; ``placement.plan_placement`` turns one
into the other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from federation.inventory import fit

#: Utilisation a replica is planned at (the autoscaler's band centre).
TARGET_UTILISATION = 0.65

RESIDENCY = "residency"
NO_FITTING_POOL = "no_fitting_pool"
NO_FREE_GPUS = "no_free_gpus"
#: Allowed regions fit the model, but no link reaches them from the origin.
UNREACHABLE = "unreachable"


class PlacementError(RuntimeError):
    """HiGHS found no plan (a bug: the programme is feasible by construction, every
    demand having an unserved slack) or ran out of time before finding one."""


@dataclass(frozen=True, slots=True)
class PoolOffer:
    """One pool the planner may place replicas on."""

    #: ``<region>/<pool>``, unique.
    key: str
    region: str
    spec: fit.PoolSpec
    relative_speed: float
    price_per_gpu_hour: float
    capacity_type: str = "on_demand"
    #: GPUs claimed by deployments the planner does not manage (other roles): whole nodes are
    #: set aside for them.
    reserved_gpus: int = 0
    #: False when cordoned: no replicas beyond the ones it runs now.
    accepts_new: bool = True

    @property
    def free_nodes(self) -> int:
        reserved_nodes = math.ceil(max(0, self.reserved_gpus) / self.spec.gpus_per_node)
        return max(0, self.spec.node_count - reserved_nodes)


@dataclass(frozen=True, slots=True)
class PlannedModel:
    name: str
    spec: fit.ModelSpec
    params_b: float
    #: Engine flags a new deployment starts with (``max-model-len`` changes the memory fit).
    engine_args: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Demand:
    residency_class: str
    origin: str
    model: str
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Current:
    """A deployment running now: the planner keeps its TP size and honours its floor."""

    model: str
    pool: str
    tensor_parallel_size: int
    replicas: int
    min_replicas: int = 0


@dataclass(frozen=True, slots=True)
class PlacementInput:
    pools: Sequence[PoolOffer]
    models: Sequence[PlannedModel]
    demand: Sequence[Demand]
    #: Residency class -> the region codes its demand may be served in.
    classes: Mapping[str, frozenset[str]]
    current: Sequence[Current] = ()
    #: ``(region, model)`` -> tokens/s served by capacity the planner does not manage (static
    #: pools), already at the target utilisation.
    fixed_capacity: Mapping[tuple[str, str], float] = field(default_factory=dict)
    #: ``(origin, region)`` -> round trip, ms (the region links). None: every region is
    #: reachable from every other at ``remote_usd_per_mtok``; given: only the origin and the
    #: listed pairs, at ``latency_usd_per_mtok_per_ms`` per millisecond.
    rtt_ms: Mapping[tuple[str, str], float] | None = None


@dataclass(frozen=True, slots=True)
class PlannerPolicy:
    #: Utilisation a replica is planned at, and the band around it within which the replicas
    #: running now are kept (the autoscaler's: ``federation.fleet.autoscaler``).
    target: float = TARGET_UTILISATION
    low: float = 0.60
    high: float = 0.70
    #: A replica added or removed costs this share of one hour of its GPUs (a cold start and
    #: the disruption): a move pays only when it saves more than twice this per hour.
    churn_weight: float = 0.25
    #: Serving a token outside its origin region, USD per million tokens (75 ms of RTT at the
    #: demand split's lambda): local capacity is preferred at equal price.
    remote_usd_per_mtok: float = 0.015
    #: The demand split's lambda (``federation.routing.demand``), when RTTs are given.
    latency_usd_per_mtok_per_ms: float = 0.0002
    #: A token/s left unserved costs this many times the dearest replica's hourly price, so
    #: the solver leaves demand unserved only when no replica can take it.
    unserved_weight: float = 10.0
    #: HiGHS stops at this relative gap between the plan and the best bound (2 %: a few
    #: dollars an hour on a fleet of hundreds of GPUs) or after ``time_limit_s`` with the best
    #: plan found; ``Plan.status`` and ``Plan.gap`` say which.
    time_limit_s: float = 30.0
    mip_rel_gap: float = 0.02


@dataclass(frozen=True, slots=True)
class Placement:
    """Replicas of a model on a pool before and after the plan."""

    model: str
    pool: str
    region: str
    tensor_parallel_size: int
    before: int
    after: int
    #: Tokens/s one replica sustains at full load.
    replica_tokens_per_s: float
    usd_per_replica_hour: float

    @property
    def action(self) -> str:
        if self.before == self.after:
            return "keep"
        if self.before == 0:
            return "create"
        return "remove" if self.after == 0 else "resize"


@dataclass(frozen=True, slots=True)
class Unserved:
    residency_class: str
    origin: str
    model: str
    tokens_per_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class NodeUse:
    """``count`` nodes of a pool holding the same replicas (model, TP) each."""

    count: int
    replicas: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Plan:
    placements: tuple[Placement, ...]
    unserved: tuple[Unserved, ...]
    #: Pool key -> how its nodes are filled (single-node replicas; a multi-node replica takes
    #: ``tp / gpus_per_node`` whole nodes and is listed with a count of that many).
    nodes: Mapping[str, tuple[NodeUse, ...]]
    #: ``(serving region, model)`` -> tokens/s the plan sends there.
    served: Mapping[tuple[str, str], float]
    usd_per_hour_before: float
    usd_per_hour_after: float
    gpus_before: int
    gpus_after: int
    solve_s: float
    #: "optimal" (within the policy's gap) or "time_limit" (the best plan found in time).
    status: str
    #: Relative gap between this plan's objective and HiGHS's bound.
    gap: float

    @property
    def changes(self) -> int:
        """Replicas started plus replicas stopped."""
        return sum(abs(p.after - p.before) for p in self.placements)
