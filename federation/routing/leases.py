"""Budget leases: each edge's share of a monthly budget, granted and never taken back. Pure.

An edge cannot ask the control plane before every request, and the control plane hears of
spend only once records are ingested; so each edge is granted a *ceiling* on what it may commit
of a budget this month — spend it settled plus the worst case of requests in flight — and
spends only within it (``regions/edge/budget.py``). The table carries a ceiling as the spend
counted of that edge plus a lease on top.

A ceiling, once published, is never lowered: the edge may already have committed all of it,
and nothing it reports says otherwise. So each compile grants only what no edge holds yet —
the budget minus every edge's claim (its last ceiling, or its counted spend if more) — and the
ceilings add up to at most the budget. The overshoot is then bounded by what requests in
flight spend beyond the worst case their edge held (``docs/adr/0008-budget-leases.md``).
Amounts are integers of pico-USD (``regions/tables/money.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from regions.tables import schema

#: Spend at or above this share of a monthly budget is published as ``warn``.
BUDGET_WARN_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class BudgetRow:
    """A tenant's budgets and what has been counted against them this month."""

    #: The UTC month, ``YYYY-MM``.
    month: str
    #: The tenant's monthly budget, pico-USD (None: only some of its keys have one).
    budget: int | None
    #: Spend counted this month, pico-USD, by (key prefix, edge that served it).
    counted: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: Ceilings the last published table granted this month, by (key prefix or "", edge).
    granted: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: Key prefix -> that key's own monthly budget, pico-USD.
    key_budgets: Mapping[str, int] = field(default_factory=dict)
    #: The tenant's own prices where they differ from the list prices.
    prices: Mapping[str, schema.ModelPrice] = field(default_factory=dict)


def budget_state(budget: int, spent: int) -> schema.BudgetState:
    """``exhausted`` at or over budget, ``warn`` from :data:`BUDGET_WARN_SHARE`, else ``ok``."""
    if spent >= budget:
        return "exhausted"
    return "warn" if spent >= BUDGET_WARN_SHARE * budget else "ok"


def split_grant(grant: int, counted: Mapping[str, int], edges: Sequence[str]) -> list[int]:
    """``grant`` split over ``edges`` by their share of the spend counted this month (evenly
    while none of them has any), rounded down so the slices never add up to more.

    By spend, because a grant is never taken back: what an edge that serves none of the
    tenant's traffic is granted stays unused until the month ends.
    """
    if not edges or grant <= 0:
        return [0] * len(edges)
    spent = [max(counted.get(e, 0), 0) for e in edges]
    total = sum(spent)
    if total == 0:
        return [grant // len(edges)] * len(edges)
    return [grant * s // total for s in spent]


#: Share of the ungranted budget a compile grants: the rest stays for the edges where demand
#: shows up next (a grant is never taken back).
GRANT_SHARE = (1, 2)


def budget_leases(
    month: str,
    budget: int,
    counted: Mapping[str, int],
    edges: Sequence[str],
    granted: Mapping[str, int] | None = None,
) -> schema.Budget:
    """One budget's leases. ``counted``: this month's counted spend by edge (every edge that
    served it, live or not); ``granted``: the ceilings already published this month; ``edges``:
    the live edges that may serve it, which share half of what nobody holds yet. An edge with
    a ceiling that is not live keeps it (it may only have lost touch), without a new share."""
    granted = granted or {}
    claims = {e: max(granted.get(e, 0), counted.get(e, 0)) for e in {*granted, *counted}}
    free = budget - sum(claims.values())
    num, den = GRANT_SHARE
    ceilings = dict(claims)
    for edge, share in zip(edges, split_grant(free * num // den, counted, edges), strict=True):
        ceilings[edge] = claims.get(edge, 0) + share
    return schema.Budget(
        month=month,
        state=budget_state(budget, sum(counted.values())),
        leases={
            edge: schema.Lease(counted=counted.get(edge, 0), lease=ceiling - counted.get(edge, 0))
            for edge, ceiling in sorted(ceilings.items())
            if edge  # records without an edge name count, but nobody leases under ""
        },
    )


def tenant_budget(row: BudgetRow, edges: Sequence[str]) -> schema.TenantBudget:
    """The table entry of a tenant's budgets, leased to ``edges``."""
    counted: dict[str, dict[str, int]] = {}
    for (key, edge), amount in row.counted.items():
        by_edge = counted.setdefault("", {})
        by_edge[edge] = by_edge.get(edge, 0) + amount
        if key:
            counted.setdefault(key, {})[edge] = amount
    granted: dict[str, dict[str, int]] = {}
    for (key, edge), ceiling in row.granted.items():
        granted.setdefault(key, {})[edge] = ceiling
    edges = sorted(edges)

    def leases(key: str, budget: int) -> schema.Budget:
        return budget_leases(row.month, budget, counted.get(key, {}), edges, granted.get(key, {}))

    return schema.TenantBudget(
        tenant=None if row.budget is None else leases("", row.budget),
        prices=dict(sorted(row.prices.items())),
        keys={key: leases(key, budget) for key, budget in sorted(row.key_budgets.items())},
    )


def granted_ceilings(
    tenants: Sequence[schema.TenantPolicy], month: str
) -> dict[str, dict[tuple[str, str], int]]:
    """Tenant -> (key prefix or "", edge) -> the ceiling a published table granted in
    ``month`` (what :func:`budget_leases` reads back as ``granted``)."""
    ceilings: dict[str, dict[tuple[str, str], int]] = {}
    for policy in tenants:
        budget = policy.budget
        if budget is None:
            continue
        scopes = [(k, b) for k, b in budget.keys.items()]
        if budget.tenant is not None:
            scopes.append(("", budget.tenant))
        for key, scope in scopes:
            if scope.month != month:
                continue
            for edge, lease in scope.leases.items():
                ceilings.setdefault(policy.tenant, {})[(key, edge)] = lease.counted + lease.lease
    return ceilings
