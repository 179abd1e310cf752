"""What an action would do to routing, before it runs: the fleet snapshot the worker compiles
from, changed as the action would change it, compiled again by the same compiler, and every
(tenant group, edge region, model) decided on both sets of tables by the edge's own rules
(``console.explain``). Pure: the caller loads the snapshot, which need not carry tenants' keys
or budget leases (``fleet_snapshot(keys_and_budgets=False)``): a decision reads a tenant's
allowed regions, residency class and budget state only.

Tenants with the same allowed regions and budget state are decided alike, so they are grouped:
5,000 tenants in three jurisdictions are a handful of rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from console.explain import Decision, decide
from federation.routing.compiler import FleetPlan, fleet_plan, region_table
from federation.routing.snapshot import FleetSnapshot
from federation.routing.tenant_plan import TenantPlan
from regions.edge.policy import spill_plan
from regions.tables.schema import RoutingTable, TenantPolicy

#: How many tenant names a preview row lists before it says "and N more".
NAMES_SHOWN = 8


def snapshot_after(
    snapshot: FleetSnapshot,
    *,
    instance_states: Mapping[str, str] | None = None,
    region_status: Mapping[str, str] | None = None,
    restored_at: Mapping[str, datetime] | None = None,
) -> FleetSnapshot:
    """``snapshot`` as the action leaves the fleet: instances in new states, regions with a
    new status (and restore time). The memo of plans is not carried over."""
    states = instance_states or {}
    status = region_status or {}
    restored = restored_at or {}
    return dataclasses.replace(
        snapshot,
        instances=tuple(
            dataclasses.replace(i, state=states[i.name]) if i.name in states else i
            for i in snapshot.instances
        ),
        regions=tuple(
            dataclasses.replace(
                r,
                status=status.get(r.code, r.status),
                restored_at=restored.get(r.code, r.restored_at),
            )
            for r in snapshot.regions
        ),
        plans={},
    )


@dataclass(frozen=True, slots=True)
class TenantGroup:
    policy: TenantPolicy
    tenants: tuple[str, ...]

    @property
    def shown(self) -> str:
        names = ", ".join(self.tenants[:NAMES_SHOWN])
        more = len(self.tenants) - NAMES_SHOWN
        return f"{names} and {more} more" if more > 0 else names


@dataclass(frozen=True, slots=True)
class Move:
    group: TenantGroup
    origin: str
    model: str
    before: Decision
    after: Decision

    @property
    def refused(self) -> bool:
        return self.after.region is None and self.before.region is not None


@dataclass(slots=True)
class Preview:
    #: The tenants' part of the plan before the action, for the next preview to reuse.
    tenant_plan: TenantPlan | None = field(default=None, compare=False, repr=False)
    moves: list[Move] = field(default_factory=list)
    #: Instances that stop or start receiving traffic.
    leaving: list[str] = field(default_factory=list)
    joining: list[str] = field(default_factory=list)
    #: USD per hour of the GPUs that serve traffic, and of the expected demand at their cost.
    serving_usd_per_hour: tuple[float, float] = (0.0, 0.0)
    demand_usd_per_hour: tuple[float, float] = (0.0, 0.0)
    #: Expected demand no allowed region can take, tokens/s.
    unserved_tokens_per_s: tuple[float, float] = (0.0, 0.0)

    @property
    def refusals(self) -> list[Move]:
        return [m for m in self.moves if m.refused]

    @property
    def changes_routing(self) -> bool:
        return bool(self.moves or self.leaving or self.joining)


def _tables(snapshot: FleetSnapshot, plan: FleetPlan) -> dict[str, RoutingTable]:
    return {
        code: region_table(snapshot, region=code, version=0, generated_at="", plan=plan)
        for code in sorted(plan.regions)
    }


def _groups(tenants: Iterable[TenantPolicy]) -> list[TenantGroup]:
    by_rule: dict[tuple[tuple[str, ...], str, str | None], list[TenantPolicy]] = {}
    for t in tenants:
        by_rule.setdefault((t.allowed_regions, t.budget_state, t.residency_class), []).append(t)
    return [
        TenantGroup(policies[0], tuple(sorted(p.tenant for p in policies)))
        for _, policies in sorted(by_rule.items(), key=lambda kv: kv[0][:2])
    ]


def _costs(plan: FleetPlan) -> tuple[float, float, float]:
    serving = sum(s.usd_per_hour for s in plan.supply.values())
    demand = sum(
        load * plan.supply[key].cost_per_mtok * 3600.0 / 1e6
        for key, load in plan.split.load.items()
        if key in plan.supply
    )
    unserved = sum(plan.split.origin_unserved.values())
    return serving, demand, unserved


def preview(
    before: FleetSnapshot, after: FleetSnapshot, *, reuse: TenantPlan | None = None
) -> Preview:
    """Every decision that differs between the tables of ``before`` and ``after``.

    ``reuse``: the tenants' part of an earlier plan (an earlier preview's ``tenant_plan``),
    which ``fleet_plan`` takes only if it was computed from the same tenants and regions.
    """
    plan_b = fleet_plan(before, reuse=reuse)
    # The same tenants: their classes and entries are computed once (``fleet_plan`` checks).
    plan_a = plan_b if after == before else fleet_plan(after, reuse=plan_b.tenant_plan)
    tables_b, tables_a = _tables(before, plan_b), _tables(after, plan_a)
    spill_b = {c: spill_plan(t) for c, t in tables_b.items()}
    spill_a = {c: spill_plan(t) for c, t in tables_a.items()}
    models = sorted(set(plan_b.serving) | set(plan_a.serving))
    # Requests reach regions that have an edge (all of them when none is registered yet).
    origins = [r.code for r in before.regions if r.edge_url] or [r.code for r in before.regions]
    result = Preview(tenant_plan=plan_b.tenant_plan)
    for group in _groups(plan_b.tenant_entries):
        for origin in sorted(origins):
            for model in models:
                was = decide(tables_b[origin], group.policy, model, plan=spill_b[origin])
                now = decide(tables_a[origin], group.policy, model, plan=spill_a[origin])
                if was.key != now.key:
                    result.moves.append(Move(group, origin, model, was, now))
    routable_b = {i.id for entries in plan_b.instance_entries.values() for i in entries}
    routable_a = {i.id for entries in plan_a.instance_entries.values() for i in entries}
    result.leaving = sorted(routable_b - routable_a)
    result.joining = sorted(routable_a - routable_b)
    cost_b, cost_a = _costs(plan_b), _costs(plan_a)
    result.serving_usd_per_hour = (cost_b[0], cost_a[0])
    result.demand_usd_per_hour = (cost_b[1], cost_a[1])
    result.unserved_tokens_per_s = (cost_b[2], cost_a[2])
    return result
