"""Budget leases: each edge's ceiling on a monthly budget, granted and taken back safely. Pure.

An edge cannot ask the control plane before every request, and the control plane hears of
spend only once records are ingested; so each edge is granted a *ceiling* on what it may commit
of a budget this month — spend it settled plus the worst case of requests in flight — and
spends only within it (``regions/edge/policy/budget.py``). The table carries a ceiling as the spend
counted of that edge plus a lease on top.

Each compile first works out what every edge may *hold*: the highest ceiling it may still be
spending under — the last table's, or an earlier one's (``prior``) while it has not applied
the last — or, once it has reported on the last table what it committed, the larger of that and
the last ceiling. It grants half of what nobody holds (half of that evenly over the live edges,
half by their share of the spend counted this month). A live edge that reported on the last
table gets a new ceiling from what it committed plus half of what it left unused, which is how a
ceiling it does not use is taken back (half per report: never all at once, which could leave
every edge without room); the rest keep theirs. Whatever each edge holds or is newly granted
adds up to at most the budget, so the overshoot is bounded by what requests in flight spend
beyond the worst case their edge held (``docs/adr/0008-budget-leases.md``). Amounts are
integers of pico-USD (``regions/tables/money.py``).

A key's own budget is granted the same way to (key prefix, edge) pairs: the edge keeps an
account per prefix, and a key in rotation grace is served under two (:func:`key_leases`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from regions.tables import schema

#: Who a ceiling is granted to: an edge, or for a key's budget a (key prefix, edge) pair.
H = TypeVar("H", bound=Hashable)

#: Spend at or above this share of a monthly budget is published as ``warn``.
BUDGET_WARN_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class Published:
    """What the last published table said of one budget at one edge, pico-USD."""

    counted: int
    ceiling: int
    prior: int = 0


@dataclass(frozen=True, slots=True)
class KeyBudget:
    """An API key's own monthly budget, pico-USD. A rotation gives the key a new public prefix
    (what usage records and the edges name it by), so it is one budget over all of them."""

    budget: int
    #: The prefixes its secrets are sent with now: the current one, and one still in rotation
    #: grace. Each is leased (the edge keeps one account per prefix), all from this budget.
    live: tuple[str, ...]
    #: Every prefix it had this month (``live`` included; empty: just ``live``): spend counted
    #: under any of them is the key's.
    prefixes: tuple[str, ...] = ()

    def known_as(self) -> frozenset[str]:
        return frozenset((*self.live, *self.prefixes))


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
    #: The keys of the tenant that have a budget of their own.
    key_budgets: Sequence[KeyBudget] = ()
    #: The tenant's own prices where they differ from the list prices.
    prices: Mapping[str, schema.ModelPrice] = field(default_factory=dict)


def budget_state(budget: float, spent: float) -> schema.BudgetState:
    """``exhausted`` at or over budget, ``warn`` from :data:`BUDGET_WARN_SHARE`, else ``ok``."""
    if spent >= budget:
        return "exhausted"
    return "warn" if spent >= BUDGET_WARN_SHARE * budget else "ok"


def split_grant(grant: int, counted: Mapping[H, int], edges: Sequence[H]) -> list[int]:
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
    found = ceilings(budget, counted, edges, published, committed)
    return _budget(month, budget_state(budget, sum(counted.values())), found, counted)


def ceilings(
    budget: int,
    counted: Mapping[H, int],
    holders: Sequence[H],
    published: Mapping[H, Published] | None = None,
    committed: Mapping[H, int] | None = None,
) -> dict[H, tuple[int, int]]:
    """Holder -> (its new ceiling, what it held before) for one budget: every holder that
    counted spend or was leased, and the live ``holders`` that may serve it now."""
    published = published or {}
    committed = committed or {}
    holds = {
        h: _hold(counted.get(h, 0), published.get(h), committed.get(h))
        for h in {*counted, *published}
    }
    free = budget - sum(holds.values())
    num, den = GRANT_SHARE
    found = {h: (hold, hold) for h, hold in holds.items()}
    for h, share in zip(holders, split_grant(free * num // den, counted, holders), strict=True):
        hold = holds.get(h, 0)
        found[h] = (_base(hold, counted.get(h, 0), committed.get(h)) + share, hold)
    return found


def _base(hold: int, counted: int, reported: int | None) -> int:
    """What an edge's new ceiling starts from, before its share of the grant: what it may hold
    while it has not reported on the last table; once it has, what it committed plus half of
    what it left unused. Taking back all of it at once left every edge with no room when the
    holds of the others had used up the budget (nothing free, so no share): each edge that
    reported in the same round then refused every request until the next compile after its next
    heartbeat. Half per report still returns an unused ceiling within a few compiles, and never
    exceeds the hold, so ceilings and holds still add up to at most the budget."""
    if reported is None:
        return hold
    used = max(reported, counted)
    return used + max(hold - used, 0) // 2


def _budget(
    month: str,
    state: schema.BudgetState,
    found: Mapping[str, tuple[int, int]],
    counted: Mapping[str, int],
) -> schema.Budget:
    """The table's budget of what :func:`ceilings` found, by edge."""
    return schema.Budget(
        month=month,
        state=state,
        leases={
            edge: schema.Lease(
                counted=counted.get(edge, 0), lease=ceiling - counted.get(edge, 0), prior=prior
            )
            for edge, (ceiling, prior) in sorted(found.items())
            if edge  # records without an edge name count, but nobody leases under ""
        },
    )


def key_leases(
    month: str,
    key: KeyBudget,
    counted: Mapping[tuple[str, str], int],
    edges: Sequence[str],
    published: Mapping[tuple[str, str], Published],
    committed: Mapping[tuple[str, str], int],
) -> dict[str, schema.Budget]:
    """A key's budget, leased per live prefix x live edge: during a rotation's grace both of
    its secrets are served, each under its own prefix, from the one budget; the mappings are
    keyed by (prefix, edge), the state is that of the key's spend under all its prefixes."""
    mine = key.known_as()
    counted = {h: v for h, v in counted.items() if h[0] in mine}
    found = ceilings(
        key.budget,
        counted,
        [(prefix, edge) for prefix in key.live for edge in edges],
        {h: v for h, v in published.items() if h[0] in mine},
        {h: v for h, v in committed.items() if h[0] in mine},
    )
    state = budget_state(key.budget, sum(counted.values()))
    return {
        prefix: _budget(
            month,
            state,
            {edge: v for (of, edge), v in found.items() if of == prefix},
            {edge: v for (of, edge), v in counted.items() if of == prefix},
        )
        for prefix in key.live
    }


def _hold(counted: int, published: Published | None, committed: int | None) -> int:
    """The most an edge may commit of a budget before it applies the next table."""
    if published is None:
        return counted
    if committed is not None:  # it has applied the last table: earlier ones no longer bind
        return max(counted, committed, published.ceiling)
    return max(counted, published.ceiling, published.prior)


def tenant_budget(row: BudgetRow, edges: Sequence[str]) -> schema.TenantBudget:
    """The table entry of a tenant's budgets, leased to the live ``edges``."""
    counted: dict[str, int] = {}
    for (_, edge), amount in row.counted.items():
        counted[edge] = counted.get(edge, 0) + amount
    edges = sorted(edges)
    keys: dict[str, schema.Budget] = {}
    for key in row.key_budgets:
        keys.update(key_leases(row.month, key, row.counted, edges, row.published, row.committed))
    tenant = None
    if row.budget is not None:
        tenant = budget_leases(
            row.month,
            row.budget,
            counted,
            edges,
            {edge: lease for (key, edge), lease in row.published.items() if not key},
            {edge: amount for (key, edge), amount in row.committed.items() if not key},
        )
    return schema.TenantBudget(
        tenant=tenant, prices=dict(sorted(row.prices.items())), keys=dict(sorted(keys.items()))
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
