"""Budget leases: each edge's slice of what remains of a monthly budget. Pure.

An edge cannot ask the control plane before every request, and the control plane hears of
spend only once records are ingested; so every budget's remaining amount is split among the
edges that may serve it, and each edge spends only its slice (``regions/edge/budget.py``).
The slices add up to at most what remained when the table was compiled, which bounds the
overshoot by what requests in flight spend beyond their worst case
(``docs/adr/0008-budget-leases.md``). Amounts are integers of pico-USD
(``regions/tables/money.py``).
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
    #: Key prefix -> that key's own monthly budget, pico-USD.
    key_budgets: Mapping[str, int] = field(default_factory=dict)
    #: The tenant's own prices where they differ from the list prices.
    prices: Mapping[str, schema.ModelPrice] = field(default_factory=dict)


def budget_state(budget: int, spent: int) -> schema.BudgetState:
    """``exhausted`` at or over budget, ``warn`` from :data:`BUDGET_WARN_SHARE`, else ``ok``."""
    if spent >= budget:
        return "exhausted"
    return "warn" if spent >= BUDGET_WARN_SHARE * budget else "ok"


def split_remaining(remaining: int, counted: Mapping[str, int], edges: Sequence[str]) -> list[int]:
    """``remaining`` split over ``edges``: half evenly, half by each one's share of the spend
    counted so far (evenly while nothing is), rounded down so the slices never add up to more.

    Half by spend, so an edge that serves most of a tenant's traffic gets most of its budget;
    half evenly, so an edge that has served none yet is not starved when traffic moves to it.
    """
    if not edges or remaining <= 0:
        return [0] * len(edges)
    n = len(edges)
    spent = [max(counted.get(e, 0), 0) for e in edges]
    total = sum(spent)
    if total == 0:
        return [remaining // n] * n
    # remaining x (1/2n + s/2total) = remaining x (total + n s) / (2 n total), in integers.
    return [remaining * (total + n * s) // (2 * n * total) for s in spent]


def budget_leases(
    month: str, budget: int, counted: Mapping[str, int], edges: Sequence[str]
) -> schema.Budget:
    """One budget's leases: ``counted`` is this month's counted spend by edge (every edge that
    served it, live or not), ``edges`` the live edges that may serve it."""
    spent = sum(counted.values())
    slices = split_remaining(budget - spent, counted, edges)
    return schema.Budget(
        month=month,
        state=budget_state(budget, spent),
        leases={
            edge: schema.Lease(counted=counted.get(edge, 0), lease=share)
            for edge, share in zip(edges, slices, strict=True)
        },
    )


def tenant_budget(row: BudgetRow, edges: Sequence[str]) -> schema.TenantBudget:
    """The table entry of a tenant's budgets, leased to ``edges``."""
    by_edge: dict[str, int] = {}
    by_key: dict[str, dict[str, int]] = {}
    for (key, edge), amount in row.counted.items():
        by_edge[edge] = by_edge.get(edge, 0) + amount
        by_key.setdefault(key, {})[edge] = amount
    edges = sorted(edges)
    return schema.TenantBudget(
        tenant=None if row.budget is None else budget_leases(row.month, row.budget, by_edge, edges),
        prices=dict(sorted(row.prices.items())),
        keys={
            key: budget_leases(row.month, budget, by_key.get(key, {}), edges)
            for key, budget in sorted(row.key_budgets.items())
        },
    )
