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

The planner's input and output types are in ``placement_types``, the programme (its columns,
rows and solution) in ``placement_milp``; this module assembles one from the other and reads
the plan back.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from federation.fleet.placement_milp import (
    EPS,
    Commodity,
    Option,
    Programme,
    add_capacity,
    add_packing,
    demand_commodities,
    flow_cost,
    placement_options,
    solve,
)
from federation.fleet.placement_types import (
    NO_FREE_GPUS,
    NodeUse,
    Placement,
    PlacementInput,
    Plan,
    PlannerPolicy,
    Unserved,
)
from federation.inventory import fit


def plan_placement(data: PlacementInput, policy: PlannerPolicy | None = None) -> Plan:
    """Solve the placement; see the module docstring and ADR 0009."""
    policy = policy or PlannerPolicy()
    started = time.perf_counter()
    options = placement_options(data)
    commodities, member, dropped = demand_commodities(data, options)
    dearest = max((o.usd_per_hour for o in options), default=1.0)
    unserved_cost = policy.unserved_weight * max(dearest, 1.0)
    prog = Programme()
    n = []
    for o in options:
        most = o.pool.spec.total_gpus // fit.replica_gpus(o.tp)
        upper = most if o.pool.accepts_new else min(most, o.current)
        n.append(prog.column(o.usd_per_hour, min(o.floor, upper), upper, integer=True))
    for j, o in enumerate(options):  # churn: n - plus + minus = current
        plus = prog.column(policy.churn_weight * o.usd_per_hour, 0, np.inf, integer=False)
        minus = prog.column(policy.churn_weight * o.usd_per_hour, 0, np.inf, integer=False)
        prog.row([(n[j], 1.0), (plus, -1.0), (minus, 1.0)], o.current, o.current)
    layout = add_packing(prog, options, n)
    ordered = sorted(commodities, key=lambda c: (c[0], c[1], sorted(c[2])))
    flows: dict[tuple[str, str], list[tuple[int, Commodity]]] = defaultdict(list)
    slack: dict[Commodity, int] = {}
    for c in ordered:
        origin, model, targets = c
        y = {
            r: prog.column(flow_cost(data, policy, origin, r), 0, np.inf, integer=False)
            for r in sorted(targets)
        }
        slack[c] = prog.column(unserved_cost, 0, np.inf, integer=False)
        prog.row(
            [(col, 1.0) for col in y.values()] + [(slack[c], 1.0)], commodities[c], commodities[c]
        )
        for r, col in y.items():
            flows[(r, model)].append((col, c))
    running: dict[tuple[str, str], list[tuple[int, Option]]] = defaultdict(list)
    for j, o in enumerate(options):
        running[(o.pool.region, o.model)].append((n[j], o))
    add_capacity(prog, policy, data, commodities, flows, running)
    solution = solve(prog, policy, options, n)
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
            if x[col] > EPS:
                served[key] += float(x[col])
    short = {c: float(x[col]) for c, col in slack.items() if x[col] > EPS}
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
    options: Sequence[Option],
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
