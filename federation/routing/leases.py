"""Budget leases: each edge's ceiling on a monthly budget, granted and taken back safely. Pure.

An edge cannot ask the control plane before every request, and the control plane hears of
spend only once records are ingested; so each edge is granted a *ceiling* on what it may commit
of a budget this month — spend it settled plus the worst case of requests in flight — and
spends only within it (``regions/edge/budget.py``). The table carries a ceiling as the spend
counted of that edge plus a lease on top.

Each compile first works out what every edge may *hold*: the highest ceiling it may still be
spending under — the last table's, or an earlier one's (``prior``) while it has not applied
the last — or, once it has reported on the last table what it committed, the larger of that and
the last ceiling. It grants half of what nobody holds (half of that evenly over the live edges,
half by their share of the spend counted this month). A live edge that reported on the last
table gets a new ceiling from what it committed, which is how a ceiling it does not use is taken
back; the rest keep theirs. Whatever each edge holds or is newly granted adds up to at most the
budget, so the overshoot is bounded by what requests in flight spend beyond the worst case
their edge held (``docs/adr/0008-budget-leases.md``). Amounts are integers of pico-USD
(``regions/tables/money.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from regions.tables import schema

#: Spend at or above this share of a monthly budget is published as ``warn``.
BUDGET_WARN_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class Published:
    """What the last published table said of one budget at one edge, pico-USD."""

    counted: int
    ceiling: int
    prior: int = 0


@dataclass(frozen=True, slots=True)
class BudgetRow:
    """A tenant's budgets, what has been counted against them this month, and what the edges
    were granted and reported; every mapping is keyed by (key prefix or "", edge)."""

    #: The UTC month, ``YYYY-MM``.
    month: str
    #: The tenant's monthly budget, pico-USD (None: only some of its keys have one).
    budget: int | None
    #: Spend counted this month, by the edge that served it.
    counted: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: The last published table's leases this month.
    published: Mapping[tuple[str, str], Published] = field(default_factory=dict)
    #: What an edge committed, as it reported while on the last published table (only edges
    #: that did; a budget it left out is at its counted spend).
    committed: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: Key prefix -> that key's own monthly budget, pico-USD.
    key_budgets: Mapping[str, int] = field(default_factory=dict)
    #: The tenant's own prices where they differ from the list prices.
    prices: Mapping[str, schema.ModelPrice] = field(default_factory=dict)


def budget_state(budget: float, spent: float) -> schema.BudgetState:
    """``exhausted`` at or over budget, ``warn`` from :data:`BUDGET_WARN_SHARE`, else ``ok``."""
    if spent >= budget:
        return "exhausted"
    return "warn" if spent >= BUDGET_WARN_SHARE * budget else "ok"


def split_grant(grant: int, counted: Mapping[str, int], edges: Sequence[str]) -> list[int]:
    """``grant`` split over ``edges``: half evenly, half by their share of the spend counted
    this month (all evenly while none has any), rounded down so the slices never add up to
    more. Evenly in part, so an edge the tenant's traffic moves to can start at once."""
    if not edges or grant <= 0:
        return [0] * len(edges)
    n = len(edges)
    spent = [max(counted.get(e, 0), 0) for e in edges]
    total = sum(spent)
    if total == 0:
        return [grant // n] * n
    # grant x (1/2n + s/2total) = grant x (total + n s) / (2 n total), in integers.
    return [grant * (total + n * s) // (2 * n * total) for s in spent]


#: Share of the budget nobody holds that a compile grants: the rest stays for the edges where
#: demand shows up before the next compile.
GRANT_SHARE = (1, 2)


def budget_leases(
    month: str,
    budget: int,
    counted: Mapping[str, int],
    edges: Sequence[str],
    published: Mapping[str, Published] | None = None,
    committed: Mapping[str, int] | None = None,
) -> schema.Budget:
    """One budget's leases, by edge: ``counted`` spend (every edge that served it, live or
    not), ``published`` leases of the last table, ``committed`` as reported on it, and the
    ``edges`` that are live and may serve it."""
    published = published or {}
    committed = committed or {}
    holds = {
        e: _hold(counted.get(e, 0), published.get(e), committed.get(e))
        for e in {*counted, *published}
    }
    free = budget - sum(holds.values())
    num, den = GRANT_SHARE
    ceilings = dict(holds)
    for edge, share in zip(edges, split_grant(free * num // den, counted, edges), strict=True):
        reported = committed.get(edge)
        base = holds.get(edge, 0) if reported is None else max(reported, counted.get(edge, 0))
        ceilings[edge] = base + share
    return schema.Budget(
        month=month,
        state=budget_state(budget, sum(counted.values())),
        leases={
            edge: schema.Lease(
                counted=counted.get(edge, 0),
                lease=ceiling - counted.get(edge, 0),
                prior=holds.get(edge, 0),
            )
            for edge, ceiling in sorted(ceilings.items())
            if edge  # records without an edge name count, but nobody leases under ""
        },
    )


def _hold(counted: int, published: Published | None, committed: int | None) -> int:
    """The most an edge may commit of a budget before it applies the next table."""
    if published is None:
        return counted
    if committed is not None:  # it has applied the last table: earlier ones no longer bind
        return max(counted, committed, published.ceiling)
    return max(counted, published.ceiling, published.prior)


def tenant_budget(row: BudgetRow, edges: Sequence[str]) -> schema.TenantBudget:
    """The table entry of a tenant's budgets, leased to the live ``edges``."""
    counted: dict[str, dict[str, int]] = {}
    for (key, edge), amount in row.counted.items():
        total = counted.setdefault("", {})
        total[edge] = total.get(edge, 0) + amount
        if key:
            counted.setdefault(key, {})[edge] = amount
    published: dict[str, dict[str, Published]] = {}
    for (key, edge), lease in row.published.items():
        published.setdefault(key, {})[edge] = lease
    committed: dict[str, dict[str, int]] = {}
    for (key, edge), amount in row.committed.items():
        committed.setdefault(key, {})[edge] = amount
    edges = sorted(edges)

    def leases(key: str, budget: int) -> schema.Budget:
        return budget_leases(
            row.month,
            budget,
            counted.get(key, {}),
            edges,
            published.get(key, {}),
            committed.get(key, {}),
        )

    return schema.TenantBudget(
        tenant=None if row.budget is None else leases("", row.budget),
        prices=dict(sorted(row.prices.items())),
        keys={key: leases(key, budget) for key, budget in sorted(row.key_budgets.items())},
    )


def published_leases(
    tenants: Sequence[schema.TenantPolicy], month: str
) -> dict[str, dict[tuple[str, str], Published]]:
    """Tenant -> (key prefix or "", edge) -> what a published table leased in ``month``
    (read back by the next compile as :attr:`BudgetRow.published`)."""
    found: dict[str, dict[tuple[str, str], Published]] = {}
    for policy in tenants:
        budget = policy.budget
        if budget is None:
            continue
        for key, scope in budget.scopes():
            if scope.month != month:
                continue
            for edge, lease in scope.leases.items():
                found.setdefault(policy.tenant, {})[(key, edge)] = Published(
                    counted=lease.counted, ceiling=lease.counted + lease.lease, prior=lease.prior
                )
    return found
