"""Where the fleet's replicas should run: a mixed-integer programme solved by HiGHS. Pure, no
Django (dataclasses in, dataclasses out); the formulation is explained in
``docs/adr/0009-placement-planner.md``.

Given expected demand per residency class, origin region and model, the pools (their GPUs,
nodes, interconnect and price) and the deployments running now, choose per pool how many
replicas of which model at which tensor-parallel size run there so that

* every replica fits (``federation.inventory.fit``: memory, TP within a node unless RDMA,
  NVLink for TP > 2, heads divisible) and the replicas pack onto whole nodes;
* demand is covered at the target utilisation (65 %), each token only in a region its
  residency class allows;
* the GPU price per hour plus a churn penalty (a replica added or removed costs a cold start)
  is lowest, so a small change of demand leaves the fleet as it is.

Demand no pool can take is reported with its reason (``residency``, ``no_fitting_pool``,
``no_free_gpus``), never dropped.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from federation.inventory import fit
from federation.inventory.speed import replica_tokens_per_s

#: Tokens/s x USD per million tokens -> USD per hour.
_MTOK_PER_HOUR = 3600 / 1e6
#: Replicas and tokens/s below these are solver noise, not decisions.
_EPS = 1e-6

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


# --- options: which (model, pool, TP) may carry replicas ------------------------------------


@dataclass(frozen=True, slots=True)
class _Option:
    model: str
    pool: PoolOffer
    tp: int
    current: int
    floor: int
    cap: float  # tokens/s per replica at full load

    @property
    def usd_per_hour(self) -> float:
        return self.pool.price_per_gpu_hour * fit.replica_gpus(self.tp)


def smallest_fitting_tp(model: PlannedModel, pool: PoolOffer) -> int | None:
    """The smallest TP size at which one replica of ``model`` starts on ``pool`` (None: none).

    Throughput per GPU falls with TP (``N^0.85`` for N GPUs), so the smallest fitting size is
    the cheapest per token and packs finest; a larger one buys latency, which the planner
    does not model."""
    for tp in range(1, pool.spec.total_gpus + 1):
        problems = fit.check_parallelism(tp, model=model.spec, pool=pool.spec)
        problems += fit.check_memory(
            tp, model=model.spec, pool=pool.spec, engine_args=model.engine_args
        )
        if not problems:
            return tp
    return None


def _options(data: PlacementInput) -> list[_Option]:
    models = {m.name: m for m in data.models}
    current = {(c.model, c.pool): c for c in data.current}
    options = []
    for pool in sorted(data.pools, key=lambda p: p.key):
        for name in sorted(models):
            model = models[name]
            now = current.get((name, pool.key))
            if now is not None:
                tp = now.tensor_parallel_size
            elif pool.accepts_new:
                found = smallest_fitting_tp(model, pool)
                if found is None:
                    continue
                tp = found
            else:
                continue
            cap = replica_tokens_per_s(
                relative_speed=pool.relative_speed, tensor_parallel_size=tp, params_b=model.params_b
            )
            options.append(
                _Option(
                    model=name,
                    pool=pool,
                    tp=tp,
                    current=now.replicas if now else 0,
                    floor=now.min_replicas if now else 0,
                    cap=cap,
                )
            )
    return options


# --- node patterns: exact bin packing of single-node TP groups ------------------------------


def node_patterns(sizes: Sequence[int], gpus_per_node: int) -> list[tuple[int, ...]]:
    """Every maximal way to fill one node with replicas of the given TP sizes (counts per
    size, in the order given): no pattern has room for one more replica. Few: the
    partitions of at most 16 GPUs into the sizes in use."""
    out: list[tuple[int, ...]] = []

    def walk(i: int, left: int, counts: list[int]) -> None:
        if i == len(sizes):
            if all(s > left for s in sizes) and any(counts):
                out.append(tuple(counts))
            return
        for n in range(left // sizes[i], -1, -1):
            counts.append(n)
            walk(i + 1, left - n * sizes[i], counts)
            counts.pop()

    walk(0, gpus_per_node, [])
    return out


# --- the programme --------------------------------------------------------------------------


@dataclass
class _Programme:
    """Columns (cost, bounds, integrality) and rows (triplets and bounds) being built."""

    cost: list[float] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    vals: list[float] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)

    def column(self, cost: float, lower: float, upper: float, *, integer: bool) -> int:
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def row(self, terms: Sequence[tuple[int, float]], lower: float, upper: float) -> None:
        index = len(self.row_lower)
        for col, val in terms:
            self.rows.append(index)
            self.cols.append(col)
            self.vals.append(val)
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def solve(
        self, policy: PlannerPolicy, fixed: Mapping[int, float] | None = None
    ) -> _Solution | None:
        """The best solution HiGHS finds (``fixed``: columns held at a value); None when
        there is none (only possible with ``fixed``)."""
        if not self.cost:  # nothing to place, nothing to serve
            return _Solution(np.zeros(0), "optimal", 0.0, 0.0)
        lower, upper = np.array(self.lower), np.array(self.upper)
        for col, value in (fixed or {}).items():
            lower[col] = upper[col] = value
        matrix = coo_matrix(
            (self.vals, (self.rows, self.cols)), shape=(len(self.row_lower), len(self.cost))
        ).tocsr()
        result = milp(
            c=np.array(self.cost),
            integrality=np.array(self.integer),
            bounds=Bounds(lower, upper),
            constraints=[LinearConstraint(matrix, self.row_lower, self.row_upper)],
            options={"time_limit": policy.time_limit_s, "mip_rel_gap": policy.mip_rel_gap},
        )
        if result.x is None:
            return None
        gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
        status = "optimal" if result.status == 0 else "time_limit"
        return _Solution(result.x, status, gap, float(result.fun))


@dataclass(frozen=True, slots=True)
class _Solution:
    x: np.ndarray
    status: str
    gap: float
    objective: float


def _solve(
    prog: _Programme, policy: PlannerPolicy, options: Sequence[_Option], n: Sequence[int]
) -> _Solution:
    """The programme's best solution, or the fleet as it is when that is at least as good.

    HiGHS stops within ``mip_rel_gap`` of the optimum, and on a large fleet that slack is
    worth more than a few replicas' churn: a plan may move replicas that a slightly better
    one would keep. So the fleet as it runs (replica counts held, the rest re-solved, fast)
    is the incumbent the plan has to beat."""
    found = prog.solve(policy)
    keep = None
    if any(o.current for o in options):
        keep = prog.solve(policy, {n[j]: float(o.current) for j, o in enumerate(options)})
    if found is None and keep is None:
        raise PlacementError("HiGHS found no placement in time")
    if found is None or (keep is not None and keep.objective <= found.objective + _EPS):
        assert keep is not None
        # As close to the bound as the solver's plan, or closer: its status and gap stand.
        return keep if found is None else replace(keep, status=found.status, gap=found.gap)
    return found


Commodity = tuple[str, str, frozenset[str]]  # (origin, model, regions it may be served in)


def _reachable(data: PlacementInput, origin: str, region: str) -> bool:
    return region == origin or data.rtt_ms is None or (origin, region) in data.rtt_ms


def _flow_cost(data: PlacementInput, policy: PlannerPolicy, origin: str, region: str) -> float:
    """USD per hour of one token/s from ``origin`` served in ``region``."""
    if region == origin:
        return 0.0
    if data.rtt_ms is None:
        return policy.remote_usd_per_mtok * _MTOK_PER_HOUR
    return policy.latency_usd_per_mtok_per_ms * data.rtt_ms[(origin, region)] * _MTOK_PER_HOUR


def _commodities(
    data: PlacementInput, options: Sequence[_Option]
) -> tuple[dict[Commodity, float], dict[tuple[str, str, str], Commodity], list[Unserved]]:
    """Demand merged by (origin, model, target regions), which class went where, and the
    demand no region can take at all (with its reason)."""
    fits_in: dict[str, set[str]] = defaultdict(set)
    for o in options:
        fits_in[o.model].add(o.pool.region)
    merged: dict[Commodity, float] = defaultdict(float)
    member: dict[tuple[str, str, str], Commodity] = {}
    unplaceable: dict[tuple[str, str, str, str], float] = defaultdict(float)
    for d in data.demand:
        if d.tokens_per_s < 0 or not math.isfinite(d.tokens_per_s):
            raise ValueError(f"demand must be a finite non-negative rate: {d}")
        if d.tokens_per_s == 0:
            continue
        if d.residency_class not in data.classes:
            raise ValueError(f"unknown residency class {d.residency_class!r}")
        allowed = data.classes[d.residency_class] & fits_in[d.model]
        targets = frozenset(r for r in allowed if _reachable(data, d.origin, r))
        key = (d.residency_class, d.origin, d.model)
        if not targets:
            reason = UNREACHABLE if allowed else RESIDENCY if fits_in[d.model] else NO_FITTING_POOL
            unplaceable[(*key, reason)] += d.tokens_per_s
            continue
        commodity = (d.origin, d.model, targets)
        merged[commodity] += d.tokens_per_s
        member[key] = commodity
    dropped = [Unserved(c, o, m, tokens, why) for (c, o, m, why), tokens in unplaceable.items()]
    return dict(merged), member, dropped


def _add_packing(prog: _Programme, options: Sequence[_Option], n: Sequence[int]) -> dict:
    """Rows that pack every pool's replicas onto its free nodes; returns the pattern columns
    per pool for the layout."""
    by_pool: dict[str, list[int]] = defaultdict(list)
    for j, o in enumerate(options):
        by_pool[o.pool.key].append(j)
    layout: dict[str, tuple[list[int], list[tuple[int, ...]], list[int]]] = {}
    for key, members in by_pool.items():
        pool = options[members[0]].pool
        per_node = pool.spec.gpus_per_node
        sizes = sorted({options[j].tp for j in members if options[j].tp <= per_node})
        patterns = node_patterns(sizes, per_node) if sizes else []
        k = [prog.column(0.0, 0, pool.free_nodes, integer=True) for _ in patterns]
        for s_i, size in enumerate(sizes):
            terms = [(n[j], 1.0) for j in members if options[j].tp == size]
            terms += [(k[p_i], -float(p[s_i])) for p_i, p in enumerate(patterns) if p[s_i]]
            prog.row(terms, -np.inf, 0.0)
        spanning = [
            (n[j], float(options[j].tp // per_node)) for j in members if options[j].tp > per_node
        ]
        prog.row([(col, 1.0) for col in k] + spanning, -np.inf, float(pool.free_nodes))
        layout[key] = (k, patterns, sizes)
    return layout


def _add_band(
    prog: _Programme,
    policy: PlannerPolicy,
    flow: list[tuple[int, float]],
    running: Sequence[tuple[int, _Option]],
    fixed: float,
    most: float,
) -> int | None:
    """Capacity rows of one (region, model): what flows there is carried by its replicas.

    New capacity is planned at the target. Replicas that run now may run up to the band's top
    (``high``) before one is added, so the count grows only once their utilisation leaves the
    autoscaler's band (a linear row: ``target`` on all the capacity plus ``high - target`` on
    what runs now). It shrinks (binary ``z``) only when the rest would run at ``low`` or
    under. A few per cent of demand either way changes nothing. Returns the shrink binary
    (None where nothing runs now)."""
    now = sum(o.current for _, o in running)

    def capacity(share: float) -> list[tuple[int, float]]:
        return [(col, -share * o.cap) for col, o in running]

    if now == 0:
        prog.row(flow + capacity(policy.target), -np.inf, fixed)
        return None
    running_now = sum(o.cap * o.current for _, o in running)
    prog.row(flow + capacity(policy.high), -np.inf, fixed)
    prog.row(
        flow + capacity(policy.target), -np.inf, fixed + (policy.high - policy.target) * running_now
    )
    shrink = prog.column(0.0, 0, 1, integer=True)
    count = [(col, 1.0) for col, _ in running]
    prog.row([*count, (shrink, float(now))], float(now), np.inf)  # fewer only if shrinking
    prog.row(flow + capacity(policy.low) + [(shrink, most)], -np.inf, fixed + most)
    return shrink


def _add_capacity(
    prog: _Programme,
    policy: PlannerPolicy,
    data: PlacementInput,
    commodities: Mapping[Commodity, float],
    flows: Mapping[tuple[str, str], list[tuple[int, Commodity]]],
    running: Mapping[tuple[str, str], list[tuple[int, _Option]]],
) -> None:
    """What flows to each (region, model) is carried by its replicas (within the band), and
    no flow goes where no replica runs."""
    shrinks: dict[str, list[int]] = defaultdict(list)
    for key, cols in flows.items():
        fixed = float(data.fixed_capacity.get(key, 0.0))
        flow = [(col, 1.0) for col, _ in cols]
        most = sum(commodities[c] for _, c in cols)
        shrink = _add_band(prog, policy, flow, running[key], fixed, most)
        if shrink is not None:
            shrinks[key[1]].append(shrink)
        if fixed <= 0:
            # A flow needs at least one replica there: y <= d x (replicas of the model in the
            # region). Redundant for integers, it makes the relaxation far tighter (the strong
            # facility-location formulation), which is what makes the solve fast.
            for col, c in cols:
                there = [(n_col, -commodities[c]) for n_col, _ in running[key]]
                prog.row([(col, 1.0), *there], -np.inf, 0.0)
    for name, local in shrinks.items():
        # Demand of the "any region" kind moves between regions for free: a region's count
        # shrinks only when the model's whole fleet would also run at ``low`` or under.
        keys = [key for key in flows if key[1] == name]
        flow = [(col, 1.0) for key in keys for col, _ in flows[key]]
        reps = [(col, -policy.low * o.cap) for key in keys for col, o in running[key]]
        fixed = sum(float(data.fixed_capacity.get(key, 0.0)) for key in keys)
        most = sum(d for c, d in commodities.items() if c[1] == name)
        whole = prog.column(0.0, 0, 1, integer=True)
        prog.row([*flow, *reps, (whole, most)], -np.inf, fixed + most)
        for col in local:
            prog.row([(col, 1.0), (whole, -1.0)], -np.inf, 0.0)


def plan_placement(data: PlacementInput, policy: PlannerPolicy | None = None) -> Plan:
    """Solve the placement; see the module docstring and ADR 0009."""
    policy = policy or PlannerPolicy()
    started = time.perf_counter()
    options = _options(data)
    commodities, member, dropped = _commodities(data, options)
    dearest = max((o.usd_per_hour for o in options), default=1.0)
    unserved_cost = policy.unserved_weight * max(dearest, 1.0)
    prog = _Programme()
    n = []
    for o in options:
        most = o.pool.spec.total_gpus // fit.replica_gpus(o.tp)
        upper = most if o.pool.accepts_new else min(most, o.current)
        n.append(prog.column(o.usd_per_hour, min(o.floor, upper), upper, integer=True))
    for j, o in enumerate(options):  # churn: n - plus + minus = current
        plus = prog.column(policy.churn_weight * o.usd_per_hour, 0, np.inf, integer=False)
        minus = prog.column(policy.churn_weight * o.usd_per_hour, 0, np.inf, integer=False)
        prog.row([(n[j], 1.0), (plus, -1.0), (minus, 1.0)], o.current, o.current)
    layout = _add_packing(prog, options, n)
    ordered = sorted(commodities, key=lambda c: (c[0], c[1], sorted(c[2])))
    flows: dict[tuple[str, str], list[tuple[int, Commodity]]] = defaultdict(list)
    slack: dict[Commodity, int] = {}
    for c in ordered:
        origin, model, targets = c
        y = {
            r: prog.column(_flow_cost(data, policy, origin, r), 0, np.inf, integer=False)
            for r in sorted(targets)
        }
        slack[c] = prog.column(unserved_cost, 0, np.inf, integer=False)
        prog.row(
            [(col, 1.0) for col in y.values()] + [(slack[c], 1.0)], commodities[c], commodities[c]
        )
        for r, col in y.items():
            flows[(r, model)].append((col, c))
    running: dict[tuple[str, str], list[tuple[int, _Option]]] = defaultdict(list)
    for j, o in enumerate(options):
        running[(o.pool.region, o.model)].append((n[j], o))
    _add_capacity(prog, policy, data, commodities, flows, running)
    solution = _solve(prog, policy, options, n)
    x, status, gap = solution.x, solution.status, solution.gap
    replicas = [round(x[j]) for j in n]
    placements = tuple(
        Placement(
            model=o.model,
            pool=o.pool.key,
            region=o.pool.region,
            tensor_parallel_size=o.tp,
            before=o.current,
            after=replicas[j],
            replica_tokens_per_s=o.cap,
            usd_per_replica_hour=o.usd_per_hour,
        )
        for j, o in enumerate(options)
        if o.current or replicas[j]
    )
    served: dict[tuple[str, str], float] = defaultdict(float)
    for key, cols in flows.items():
        for col, _ in cols:
            if x[col] > _EPS:
                served[key] += float(x[col])
    short = {c: float(x[col]) for c, col in slack.items() if x[col] > _EPS}
    unserved = dropped + [
        Unserved(
            cls, origin, model, _share(data, member, (cls, origin, model), short), NO_FREE_GPUS
        )
        for (cls, origin, model), c in sorted(member.items())
        if c in short
    ]
    return Plan(
        placements=placements,
        unserved=tuple(sorted(unserved, key=lambda u: (u.model, u.origin, u.residency_class))),
        nodes=_layouts(options, replicas, layout, x),
        served=dict(served),
        usd_per_hour_before=sum(o.usd_per_hour * o.current for o in options),
        usd_per_hour_after=sum(p.usd_per_replica_hour * p.after for p in placements),
        gpus_before=sum(o.tp * o.current for o in options),
        gpus_after=sum(p.tensor_parallel_size * p.after for p in placements),
        solve_s=time.perf_counter() - started,
        status=status,
        gap=gap,
    )


def _share(
    data: PlacementInput,
    member: Mapping[tuple[str, str, str], Commodity],
    key: tuple[str, str, str],
    short: Mapping[Commodity, float],
) -> float:
    """A class's part of its commodity's shortfall, in proportion to its demand."""
    commodity = member[key]
    own = sum(d.tokens_per_s for d in data.demand if (d.residency_class, d.origin, d.model) == key)
    total = sum(
        d.tokens_per_s
        for d in data.demand
        if member.get((d.residency_class, d.origin, d.model)) == commodity
    )
    return short[commodity] * own / total


def _layouts(
    options: Sequence[_Option],
    replicas: Sequence[int],
    layout: Mapping[str, tuple[list[int], list[tuple[int, ...]], list[int]]],
    x: np.ndarray,
) -> dict[str, tuple[NodeUse, ...]]:
    """Which replicas each node holds: the chosen patterns filled with the replicas."""
    out: dict[str, tuple[NodeUse, ...]] = {}
    for key, (k, patterns, sizes) in layout.items():
        waiting: dict[int, list[str]] = defaultdict(list)
        spanning: list[NodeUse] = []
        for j, o in enumerate(options):
            if o.pool.key != key:
                continue
            if o.tp > o.pool.spec.gpus_per_node:
                for _ in range(replicas[j]):
                    spanning.append(NodeUse(o.tp // o.pool.spec.gpus_per_node, ((o.model, o.tp),)))
            else:
                waiting[o.tp].extend([o.model] * replicas[j])
        nodes: dict[tuple[tuple[str, int], ...], int] = defaultdict(int)
        for col, pattern in zip(k, patterns, strict=True):
            for _ in range(round(x[col])):
                slots = []
                for size, count in zip(sizes, pattern, strict=True):
                    for _ in range(count):
                        if waiting[size]:
                            slots.append((waiting[size].pop(0), size))
                if slots:
                    nodes[tuple(sorted(slots))] += 1
        uses = [NodeUse(count, slots) for slots, count in sorted(nodes.items())] + spanning
        if uses:
            out[key] = tuple(uses)
    return out
