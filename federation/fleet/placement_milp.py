"""The placement planner's mixed-integer programme: which (model, pool, TP) may carry replicas,
the node packing patterns, the columns and rows of the programme (packing, demand flows, the
autoscaler's band) and its solution by HiGHS. Pure, no Django: dataclasses and numpy in, a
solution vector out.

A module of its own so that ``placement`` keeps the planner's entry point (``plan_placement``,
which assembles the programme and reads the plan back from the solution) short; the names with
a leading underscore are this module's own. The formulation is explained in
``docs/adr/0009-placement-planner.md``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from federation.fleet.placement_types import (
    NO_FITTING_POOL,
    RESIDENCY,
    UNREACHABLE,
    PlacementError,
    PlacementInput,
    PlannedModel,
    PlannerPolicy,
    PoolOffer,
    Unserved,
)
from federation.inventory import fit
from federation.inventory.speed import replica_tokens_per_s

#: Tokens/s x USD per million tokens -> USD per hour.
_MTOK_PER_HOUR = 3600 / 1e6
#: Replicas and tokens/s below these are solver noise, not decisions.
EPS = 1e-6


# --- options: which (model, pool, TP) may carry replicas ------------------------------------


@dataclass(frozen=True, slots=True)
class Option:
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


def placement_options(data: PlacementInput) -> list[Option]:
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
                Option(
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
class Programme:
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


def solve(
    prog: Programme, policy: PlannerPolicy, options: Sequence[Option], n: Sequence[int]
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
    if found is None or (keep is not None and keep.objective <= found.objective + EPS):
        assert keep is not None
        # As close to the bound as the solver's plan, or closer: its status and gap stand.
        return keep if found is None else replace(keep, status=found.status, gap=found.gap)
    return found


Commodity = tuple[str, str, frozenset[str]]  # (origin, model, regions it may be served in)


def _reachable(data: PlacementInput, origin: str, region: str) -> bool:
    return region == origin or data.rtt_ms is None or (origin, region) in data.rtt_ms


def flow_cost(data: PlacementInput, policy: PlannerPolicy, origin: str, region: str) -> float:
    """USD per hour of one token/s from ``origin`` served in ``region``."""
    if region == origin:
        return 0.0
    if data.rtt_ms is None:
        return policy.remote_usd_per_mtok * _MTOK_PER_HOUR
    return policy.latency_usd_per_mtok_per_ms * data.rtt_ms[(origin, region)] * _MTOK_PER_HOUR


def demand_commodities(
    data: PlacementInput, options: Sequence[Option]
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


def add_packing(prog: Programme, options: Sequence[Option], n: Sequence[int]) -> dict:
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
    prog: Programme,
    policy: PlannerPolicy,
    flow: list[tuple[int, float]],
    running: Sequence[tuple[int, Option]],
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


def add_capacity(
    prog: Programme,
    policy: PlannerPolicy,
    data: PlacementInput,
    commodities: Mapping[Commodity, float],
    flows: Mapping[tuple[str, str], list[tuple[int, Commodity]]],
    running: Mapping[tuple[str, str], list[tuple[int, Option]]],
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
