"""Compile every region's routing table from a snapshot of the fleet. Pure: no Django, no I/O.

One :func:`fleet_plan` per snapshot does the fleet-wide work once — capacities and prices of
every (region, model), residency classes, the demand split (``demand.py``, a linear programme)
and the tenant entries — and :func:`compile_region_table` cuts one region's document out of
it. The document's schema is ``docs/routing-table.md``; the edge decodes it with
``regions.tables.schema.decode_table`` and verifies it with ``regions.tables.signing``.

Output is deterministic (everything sorted, floats rounded), so an unchanged fleet compiles to
a byte-identical body; the version and ``generated_at`` are the caller's.

A region coming back (restored after an evacuation, or its instances healthy again after all
were lost) gets its traffic back gradually: :func:`region_ramp` gives it a share that rises in
steps over :class:`RampPolicy`'s window, and the tables carry it (``ramp``, schema 2) so that
edges shift traffic back in proportion instead of all at once (docs/edge-federation.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from federation.inventory.speed import (
    prefill_tokens_per_s,
    replica_tokens_per_s,
)
from federation.routing.demand import (
    DEFAULT_LATENCY_PENALTY_USD_PER_MTOK_PER_MS,
    DemandSplit,
    Offer,
    split_shared_demand,
)
from federation.routing.ramp import region_ramp
from federation.routing.snapshot import (
    FleetSnapshot,
    InstanceRow,
    RegionRow,
)
from federation.routing.tenant_plan import ResidencyClass, TenantPlan, plan_tenants
from regions.tables import schema

#: Utilisation capacity is planned at. The mean queueing wait is rho/(1-rho) service times:
#: about two at 65 %, nine at 90 %, unbounded towards 100 % (docs/demand-split.md).
TARGET_UTILISATION = 0.65
#: A disaggregated replica is a prefill and a decode instance: each counts for half.
ROLE_CAPACITY_SHARE = {"mixed": 1.0, "prefill": 0.5, "decode": 0.5}
#: Why a model is refused to a residency class (``residency_classes[].refusals``): no region
#: the policy allows serves it, or those that do cannot be reached from this region.
REFUSAL_RESIDENCY = "residency"
REFUSAL_UNREACHABLE = "unreachable"

#: Instances in these states receive traffic; a draining instance finishes what it has.
ROUTABLE_STATES = frozenset({"ready"})
EVACUATED = "evacuated"


def cost_per_mtok(*, price_per_gpu_hour: float, gpus: int, tokens_per_s: float) -> float:
    """USD for the GPU time one million tokens occupy on a replica running flat out."""
    return price_per_gpu_hour * gpus / 3600.0 / tokens_per_s * 1e6


def _r(value: float, digits: int = 4) -> float:
    return round(value, digits) + 0.0  # + 0.0 turns -0.0 into 0.0 (stable bytes)


# --- the fleet-wide plan -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Supply:
    """What one region offers for one base model: capacity at the target and blended price."""

    capacity_tokens_per_s: float
    cost_per_mtok: float
    usd_per_hour: float
    tokens_per_s: float


@dataclass(slots=True)
class FleetPlan:
    """Everything the per-region documents share, computed once per snapshot."""

    regions: dict[str, RegionRow]
    #: (region, served name) -> the base model whose capacity serves it there (an adapter
    #: draws on its base model's GPUs).
    base_at: dict[tuple[str, str], str]
    #: served name -> serving regions (active, with ready instances).
    serving: dict[str, set[str]]
    #: (region, base model) -> supply.
    supply: dict[tuple[str, str], Supply]
    #: origin -> reachable remote regions -> rtt (active, with an edge, RTT known).
    reach: dict[str, dict[str, float]]
    classes: list[ResidencyClass]
    #: (origin, served name) -> expected demand, tokens/s.
    demand: dict[tuple[str, str], float]
    split: DemandSplit
    latency_penalty: float
    tenant_entries: tuple[schema.TenantPolicy, ...]
    #: The same with the classes and their inputs, for a plan of the same tenants to reuse.
    tenant_plan: TenantPlan
    instance_entries: dict[str, tuple[schema.Instance, ...]]
    #: (region, served name) -> its offer as :func:`_offer` rounds it (filled on first use).
    offers: dict[tuple[str, str], tuple[float, float, float, float]]
    #: class id -> served name -> refusal reason, the same from every origin.
    class_refusals: dict[str, dict[str, str]]
    #: Active regions with at least one routable instance.
    serving_regions: set[str]
    #: region -> the names it serves, sorted.
    models_at: dict[str, list[str]]
    #: region -> (USD/h, tokens/s, capacity at the target, expected load) over its models.
    region_totals: dict[str, tuple[float, float, float, float]]
    #: Active region -> share of its traffic it gets back (1 unless it is ramping or down).
    ramps: dict[str, float] = field(default_factory=dict)
    #: Seconds until some region's ramp moves to its next step (None: no ramp in progress);
    #: the publisher recompiles then.
    next_ramp_change_s: float | None = None
    #: Some tenant has a budget: the tables carry leases and prices (schema 3).
    budgeted: bool = False


def _rtt(rtt_ms: Mapping[tuple[str, str], float], a: str, b: str) -> float | None:
    """RTT is symmetric when only one direction is known."""
    value = rtt_ms.get((a, b))
    return rtt_ms.get((b, a)) if value is None else value


def _instance_tokens(row: InstanceRow) -> float:
    return replica_tokens_per_s(
        relative_speed=row.relative_speed,
        tensor_parallel_size=row.tensor_parallel_size,
        params_b=row.parameter_count_b,
    ) * ROLE_CAPACITY_SHARE.get(row.role, 1.0)


#: The database's role names as the table types them (an unknown one fails the compile).
_ROLE: dict[str, schema.Role] = {role: role for role in schema.ROLES}


def _instance_entries(rows: Iterable[InstanceRow]) -> tuple[schema.Instance, ...]:
    """Entries of one region's routable instances, with capacity weights per (model, role)."""
    ordered = sorted(rows, key=lambda r: r.name)
    caps = [_instance_tokens(r) * TARGET_UTILISATION for r in ordered]
    totals: dict[tuple[str, str], float] = {}
    for row, cap in zip(ordered, caps, strict=True):
        totals[(row.model, row.role)] = totals.get((row.model, row.role), 0.0) + cap
    return tuple(
        schema.Instance(
            id=row.name,
            url=row.endpoint_url.rstrip("/"),  # the edge appends /v1/..., /health
            model=row.model,
            adapters=tuple(row.adapters),
            role=_ROLE[row.role],
            accelerator=row.accelerator,
            tp=row.tensor_parallel_size,
            max_concurrency=row.max_num_seqs,
            prefill_tokens_per_s=round(
                prefill_tokens_per_s(
                    relative_speed=row.relative_speed,
                    tensor_parallel_size=row.tensor_parallel_size,
                    params_b=row.parameter_count_b,
                ),
                1,
            ),
            state="ready",
            capacity_tokens_per_s=_r(cap, 1),
            weight=_r(cap / totals[(row.model, row.role)]),
        )
        for row, cap in zip(ordered, caps, strict=True)
    )


def fleet_plan(
    snapshot: FleetSnapshot,
    *,
    latency_penalty: float = DEFAULT_LATENCY_PENALTY_USD_PER_MTOK_PER_MS,
    reuse: TenantPlan | None = None,
) -> FleetPlan:
    """The fleet-wide part of every table: compute once, then cut per region.

    ``reuse``: the tenants' part of another plan (``FleetPlan.tenant_plan``), taken when it
    was computed from the same tenants, regions and live edges (checked here), as for the
    fleet before and after an action on its instances.
    """
    regions = {r.code: r for r in snapshot.regions}
    active = {c for c, r in regions.items() if r.status != EVACUATED}
    routable = [
        row for row in snapshot.instances if row.state in ROUTABLE_STATES and row.region in active
    ]
    by_region: dict[str, list[InstanceRow]] = {}
    base_at: dict[tuple[str, str], str] = {}
    serving: dict[str, set[str]] = {}
    usd: dict[tuple[str, str], float] = {}
    tokens: dict[tuple[str, str], float] = {}
    for row in routable:
        by_region.setdefault(row.region, []).append(row)
    ramps: dict[str, float] = {}
    changes: list[float] = []
    for code in sorted(active):
        level, change = region_ramp(
            regions[code],
            (row.healthy for row in by_region.get(code, ())),
            now=snapshot.now,
            policy=snapshot.ramp,
        )
        ramps[code] = level
        if change is not None:
            changes.append(change)
    for row in routable:
        for name in (row.model, *row.adapters):
            base_at.setdefault((row.region, name), row.model)
            serving.setdefault(name, set()).add(row.region)
        key = (row.region, row.model)
        usd[key] = usd.get(key, 0.0) + row.price_per_gpu_hour * row.tensor_parallel_size
        tokens[key] = tokens.get(key, 0.0) + _instance_tokens(row)
    # A ramping region offers the split only its current share of its capacity.
    supply = {
        key: Supply(
            capacity_tokens_per_s=tokens[key] * TARGET_UTILISATION * ramps[key[0]],
            cost_per_mtok=usd[key] / 3600.0 / tokens[key] * 1e6 if tokens[key] else 0.0,
            usd_per_hour=usd[key],
            tokens_per_s=tokens[key],
        )
        for key in tokens
    }
    reach: dict[str, dict[str, float]] = {}
    for origin in sorted(regions):
        reach[origin] = {}
        for other in sorted(active):
            if other == origin or not regions[other].edge_url:
                continue
            rtt = _rtt(snapshot.rtt_ms, origin, other)
            if rtt is not None:
                reach[origin][other] = rtt

    tenant_plan = plan_tenants(snapshot, regions, active, reuse=reuse)
    classes, tenant_entries = tenant_plan.classes, tenant_plan.entries

    # Expected demand per (origin, served name), attributed to residency classes by
    # _origin_shares (until metering attributes demand to tenants).
    if snapshot.demand_tokens_per_s:
        # Zeros are dropped; a negative figure is refused by the split, not hidden.
        demand = {k: float(v) for k, v in snapshot.demand_tokens_per_s.items() if v != 0}
    else:
        demand = {}
        for row in routable:
            if row.load_tokens_per_s:
                key = (row.region, row.model)
                demand[key] = demand.get(key, 0.0) + row.load_tokens_per_s
    lp_classes = classes or [ResidencyClass("any", frozenset(regions), 1)]
    offers = {
        name: {
            s: Offer(supply[(s, base_at[(s, name)])].cost_per_mtok, base_at[(s, name)])
            for s in sorted(where)
        }
        for name, where in serving.items()
    }
    split = split_shared_demand(
        demand=demand,
        class_shares={o: _origin_shares(o, lp_classes) for o in sorted({o for o, _ in demand})},
        allowed={c.id: c.allowed for c in lp_classes},
        offers=offers,
        capacity={k: s.capacity_tokens_per_s for k, s in supply.items()},
        rtt_ms={(o, s): rtt for o, targets in reach.items() for s, rtt in targets.items()},
        latency_penalty=latency_penalty,
    )
    return FleetPlan(
        regions=regions,
        base_at=base_at,
        serving=serving,
        supply=supply,
        reach=reach,
        classes=classes,
        demand=demand,
        split=split,
        latency_penalty=latency_penalty,
        tenant_entries=tenant_entries,
        tenant_plan=tenant_plan,
        budgeted=any(t.budget is not None for t in tenant_entries),
        instance_entries={c: _instance_entries(rows) for c, rows in by_region.items()},
        offers={},
        class_refusals=_class_refusals(serving, classes),
        serving_regions=set(by_region),
        models_at={
            code: sorted(n for n, where in serving.items() if code in where) for code in by_region
        },
        region_totals=_region_totals(supply, split),
        ramps=ramps,
        next_ramp_change_s=min(changes) if changes else None,
    )


def _origin_shares(origin: str, classes: list[ResidencyClass]) -> dict[str, float]:
    """Who an origin's demand belongs to, until metering says: the tenants that may be served
    there (geo-steering sends clients to an edge of a region their data may live in), each
    class by its number of tenants; all classes alike when none may be served there."""
    local = [c for c in classes if origin in c.allowed] or classes
    total = sum(c.tenants for c in local)
    return {c.id: c.tenants / total for c in local}


def _region_totals(
    supply: Mapping[tuple[str, str], Supply], split: DemandSplit
) -> dict[str, tuple[float, float, float, float]]:
    totals: dict[str, tuple[float, float, float, float]] = {}
    for key, s in supply.items():
        usd, tokens, cap, load = totals.get(key[0], (0.0, 0.0, 0.0, 0.0))
        totals[key[0]] = (
            usd + s.usd_per_hour,
            tokens + s.tokens_per_s,
            cap + s.capacity_tokens_per_s,
            load + split.load.get(key, 0.0),
        )
    return totals


# --- one region's document -----------------------------------------------------------------


def _headroom(plan: FleetPlan, region: str, name: str) -> tuple[float, float]:
    """Tokens/s left at the target after the split's expected load, and as a share."""
    key = (region, plan.base_at[(region, name)])
    cap = plan.supply[key].capacity_tokens_per_s
    spare = cap - plan.split.load.get(key, 0.0)
    return spare, (spare / cap if cap > 0 else 0.0)


def _offer(plan: FleetPlan, region: str, name: str) -> tuple[float, float, float, float]:
    """(cost per Mtok, headroom tokens/s, headroom share, raw cost): the same from every
    origin, so computed once per (region, name) and rounded once."""
    key = (region, name)
    cached = plan.offers.get(key)
    if cached is None:
        cost = plan.supply[(region, plan.base_at[key])].cost_per_mtok
        spare, share = _headroom(plan, region, name)
        cached = plan.offers[key] = (_r(cost), _r(max(spare, 0.0), 1), _r(max(share, 0.0)), cost)
    return cached


def _route(plan: FleetPlan, origin: str, name: str) -> schema.ModelRoute:
    """Where ``origin``'s traffic for ``name`` goes: local share and ordered remotes."""
    where = plan.serving[name]
    local = origin in where
    remotes = [(s, rtt) for s, rtt in plan.reach[origin].items() if s in where]
    demand = plan.demand.get((origin, name), 0.0)
    weights = plan.split.origin_fractions.get((origin, name), {})
    unserved = plan.split.origin_unserved.get((origin, name), 0.0)
    penalty = plan.latency_penalty
    ranked = []  # (no headroom, cost after the latency penalty, code, rtt)
    for s, rtt in remotes:
        _, spare, _, cost = _offer(plan, s, name)
        ranked.append((spare <= 0, cost + penalty * rtt, s, rtt))
    if demand <= 0 and (remotes or local):
        # The split's answer for a vanishing demand: the cheapest target with headroom.
        options = [(h, c, s) for h, c, s, _ in ranked]
        if local:
            _, spare, _, cost = _offer(plan, origin, name)
            options.append((spare <= 0, cost, origin))
        weights = {min(options)[2]: 1.0}
    # Spill-over order: regions with headroom first, then cheapest after the latency penalty.
    ranked.sort()
    entries = []
    for _, _, s, rtt in ranked:
        cost_r, spare_r, share_r, _ = _offer(plan, s, name)
        entries.append(
            schema.RouteTarget(
                code=s,
                weight=_r(weights.get(s, 0.0)),
                rtt_ms=rtt,
                cost_per_mtok=cost_r,
                headroom_tokens_per_s=spare_r,
                headroom=share_r,
            )
        )
    capacity = headroom = cost = 0.0
    if local:
        cost, headroom, _, _ = _offer(plan, origin, name)
        capacity = _r(plan.supply[(origin, plan.base_at[(origin, name)])].capacity_tokens_per_s, 1)
    return schema.ModelRoute(
        model=name,
        demand_tokens_per_s=_r(demand, 1),
        local_weight=_r(weights.get(origin, 0.0)),
        unserved_tokens_per_s=_r(unserved, 1),
        local_capacity_tokens_per_s=capacity,
        local_headroom_tokens_per_s=headroom,
        local_cost_per_mtok=cost,
        remotes=tuple(entries),
    )


def _class_refusals(
    serving: Mapping[str, set[str]], classes: Iterable[ResidencyClass]
) -> dict[str, dict[str, str]]:
    """Served names no allowed region of a class serves anywhere (the same from every origin)."""
    return {
        cls.id: {
            name: REFUSAL_RESIDENCY for name in sorted(serving) if not serving[name] & cls.allowed
        }
        for cls in classes
    }


def _refusals(plan: FleetPlan, origin: str, cls: ResidencyClass) -> dict[str, str]:
    """The class's refusals as seen from ``origin``: residency ones, plus names whose allowed
    serving regions are all unreachable from here (no edge or no RTT link)."""
    refusals = plan.class_refusals[cls.id]
    reachable = set(plan.reach[origin])
    if plan.regions[origin].status != EVACUATED:
        reachable.add(origin)
    missing = plan.serving_regions - reachable
    if not missing:
        return refusals
    patched = dict(refusals)
    for name, where in plan.serving.items():
        permitted = where & cls.allowed
        if permitted and permitted <= missing:
            patched[name] = REFUSAL_UNREACHABLE
    return dict(sorted(patched.items()))


def _remote_region(plan: FleetPlan, code: str, rtt: float) -> schema.RemoteRegion:
    region = plan.regions[code]
    usd, tokens, cap, load = plan.region_totals.get(code, (0.0, 0.0, 0.0, 0.0))
    return schema.RemoteRegion(
        code=code,
        edge_url=(region.edge_url or "").rstrip("/"),  # remotes without an edge are skipped
        edges=tuple(url.rstrip("/") for url in region.other_edge_urls),
        rtt_ms=rtt,
        models=tuple(plan.models_at.get(code, ())),
        # Blended over its models: USD per hour of all its replicas over their tokens.
        cost_per_mtok=_r(usd / 3600.0 / tokens * 1e6) if tokens else 0.0,
        headroom=_r(max(cap - load, 0.0) / cap) if cap else 0.0,
        ramp=_r(plan.ramps.get(code, 1.0)),
    )


def _cold_models(
    snapshot: FleetSnapshot, plan: FleetPlan, region: str
) -> tuple[schema.ColdModel, ...]:
    """The region's cold models: deployed there with no ready instance, and not served there
    by another deployment; none in an evacuated region (its tenants go elsewhere)."""
    if plan.regions[region].status == EVACUATED:
        return ()
    local = set(plan.models_at.get(region, ()))
    merged: dict[str, tuple[set[str], float]] = {}
    for row in snapshot.cold:
        if row.region != region or row.model in local:
            continue
        adapters, start = merged.get(row.model, (set(), row.cold_start_s))
        adapters.update(a for a in row.adapters if a not in local)
        merged[row.model] = (adapters, min(start, row.cold_start_s))
    taken = set(merged)
    out = []
    for model, (adapters, start) in sorted(merged.items()):
        own = tuple(sorted(adapters - taken))
        taken.update(own)
        out.append(schema.ColdModel(model=model, adapters=own, cold_start_s=_r(start, 1)))
    for where, adapter in sorted(snapshot.loadable_adapters):
        if where == region and adapter not in local and adapter not in taken:
            taken.add(adapter)
            out.append(schema.ColdModel(model=adapter, cold_start_s=_r(snapshot.adapter_load_s, 1)))
    return tuple(sorted(out, key=lambda c: c.model))


def _plan_of(snapshot: FleetSnapshot, plan: FleetPlan | None) -> FleetPlan:
    """``plan``, or the snapshot's memoised plan at the default latency penalty."""
    if plan is not None:
        return plan
    memo = snapshot.plans.get(DEFAULT_LATENCY_PENALTY_USD_PER_MTOK_PER_MS)
    if memo is None:
        memo = snapshot.plans[DEFAULT_LATENCY_PENALTY_USD_PER_MTOK_PER_MS] = fleet_plan(snapshot)
    return memo


def with_adapter_prices(
    prices: Mapping[str, schema.ModelPrice], bases: Mapping[str, str]
) -> dict[str, schema.ModelPrice]:
    """List prices with every adapter of a priced base model at its base's price, sorted.

    An edge prices a request for an adapter at its base model's price when an instance here
    serves it; one that is cold (loaded where its demand appears) names no base in the table,
    and was held at no price at all — a budget did not stop it."""
    priced = dict(prices)
    for adapter, base in bases.items():
        if base in prices and adapter not in prices:
            priced[adapter] = prices[base]
    return dict(sorted(priced.items()))


def region_table(
    snapshot: FleetSnapshot,
    *,
    region: str,
    version: int,
    generated_at: str,
    plan: FleetPlan | None = None,
) -> schema.RoutingTable:
    """The routing table for ``region``, typed as the edge decodes it.

    The fleet-wide ``plan`` (demand split, tenant entries) is computed on the first call for
    a snapshot and reused for its other regions; pass one to use another latency penalty.
    """
    if region not in {r.code for r in snapshot.regions}:
        raise KeyError(f"unknown region {region!r}")
    plan = _plan_of(snapshot, plan)
    remotes = tuple(
        _remote_region(plan, code, rtt) for code, rtt in sorted(plan.reach[region].items())
    )
    classes = tuple(
        schema.ResidencyClass(
            id=cls.id,
            allowed_regions=tuple(sorted(cls.allowed)),
            refusals=_refusals(plan, region, cls),
        )
        for cls in plan.classes
    )
    own = plan.ramps.get(region, 1.0) if region in plan.serving_regions else 1.0
    ramping = own < 1.0 or any(r.ramp < 1.0 for r in remotes)
    cold = _cold_models(snapshot, plan, region)
    # Rate limits are shared by the region's live edges (1/n each): more than one needs schema 5.
    local_edges = min(max(1, len(plan.regions[region].edges)), schema.MAX_LOCAL_EDGES)
    private = dict(sorted(snapshot.private_adapters.items()))
    # Private adapters need schema 6, cold models or several local edges 5, several edges per
    # remote 4, budgets 3, a ramp 2; without any of them the table stays readable by schema 1.
    version_needed = (
        schema.PRIVATE_ADAPTERS_SCHEMA_VERSION
        if private
        else schema.COLD_SCHEMA_VERSION
        if cold or local_edges > 1
        else schema.EDGES_SCHEMA_VERSION
        if any(r.edges for r in remotes)
        else schema.BUDGET_SCHEMA_VERSION
        if plan.budgeted
        else schema.RAMP_SCHEMA_VERSION
        if ramping
        else schema.SCHEMA_VERSION
    )
    return schema.RoutingTable(
        schema_version=version_needed,
        version=version,
        region=region,
        generated_at=generated_at,
        instances=plan.instance_entries.get(region, ()),
        remote_regions=remotes,
        routes=tuple(_route(plan, region, name) for name in sorted(plan.serving)),
        residency_classes=classes,
        tenants=plan.tenant_entries,
        ramp=_r(own),
        prices=with_adapter_prices(snapshot.prices, snapshot.adapter_bases)
        if plan.budgeted
        else {},
        cold_models=cold,
        local_edges=local_edges,
        private_adapters=private,
    )


def compile_region_table(
    snapshot: FleetSnapshot,
    *,
    region: str,
    version: int,
    generated_at: str,
    plan: FleetPlan | None = None,
) -> dict[str, Any]:
    """The routing-table document for ``region``: :func:`region_table`, ready for JSON."""
    plan = _plan_of(snapshot, plan)
    table = region_table(
        snapshot, region=region, version=version, generated_at=generated_at, plan=plan
    )
    return schema.encode_table(table, encoded_tenants=plan.tenant_plan.documents())


def compile_fleet_tables(
    snapshot: FleetSnapshot,
    *,
    versions: Mapping[str, int],
    generated_at: str,
    latency_penalty: float = DEFAULT_LATENCY_PENALTY_USD_PER_MTOK_PER_MS,
) -> dict[str, dict[str, Any]]:
    """Every region's document (``versions``: region code -> its next version), one plan."""
    plan = fleet_plan(snapshot, latency_penalty=latency_penalty)
    return {
        code: compile_region_table(
            snapshot, region=code, version=versions[code], generated_at=generated_at, plan=plan
        )
        for code in sorted(plan.regions)
    }
