"""Monthly budgets at the edge: spend only this edge's lease of what remains. Pure.

The control plane cannot stop a request it has not heard of yet, so it leases each edge a slice
of every budget's remaining amount through the table (``docs/adr/0008-budget-leases.md``). Per
budget (a tenant's, or one key's) this edge keeps an :class:`Account`:

* ``spent`` — what this edge has settled this month, a running total that starts at the
  table's ``counted`` (the part of its spend the control plane has already counted);
* ``held`` — the worst-case price of its requests in flight.

A request is admitted when ``(spent - counted) + held + worst <= lease``: the spend the
control plane has not counted yet plus everything in flight stays within the slice it leased.
The slices of all edges add up to what remained of the budget when the table was compiled, so
total spend exceeds the budget by at most what requests in flight spend beyond their worst case
(an output longer than ``max_tokens`` cannot happen; a prompt longer than the edge's estimate
can) and the spend of an edge lost since its records were last counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from regions.edge.http.errors import EdgeError
from regions.tables.money import request_pusd
from regions.tables.schema import Budget, ModelPrice, RoutingTable

#: Retry-After of a request refused because this edge's slice is used up: the slice grows back
#: as soon as the control plane has counted what was spent and published a new table.
LEASE_RETRY_AFTER_S = 5
FREE = ModelPrice(0, 0, 0)


class Account:
    """One budget's lease at this edge, pico-USD. Kept across tables (requests in flight hold
    on to it); :meth:`Budgets.load` updates it in place."""

    __slots__ = ("counted", "held", "lease", "month", "spent", "state")

    def __init__(self, budget: Budget, edge: str | None) -> None:
        self.month = ""
        self.spent = 0
        self.held = 0
        self.counted = 0
        self.lease: int | None = None
        self.state = "ok"
        self.update(budget, edge)

    def update(self, budget: Budget, edge: str | None) -> None:
        lease = budget.leases.get(edge) if edge is not None else None
        counted = lease.counted if lease is not None else 0
        if budget.month != self.month:
            self.month = budget.month
            self.spent = counted
        # Never less than counted: what the control plane counted of this edge happened.
        self.spent = max(self.spent, counted)
        self.counted = counted
        self.lease = lease.lease if lease is not None else None
        self.state = budget.state

    def room(self) -> int:
        """What a new request may still hold (negative: none)."""
        if self.lease is None:
            return -1
        return self.lease - (self.spent - self.counted) - self.held


class Hold:
    """What an admitted request holds: its worst-case price on each budget that applies."""

    __slots__ = ("accounts", "amount", "prices")

    def __init__(
        self, accounts: tuple[Account, ...], amount: int, prices: Mapping[str, ModelPrice]
    ) -> None:
        self.accounts = accounts
        self.amount = amount
        self.prices = prices


class Budgets:
    """The budgets of one edge (named ``edge`` in the control plane's leases)."""

    def __init__(self, edge: str | None) -> None:
        self.edge = edge
        self._accounts: dict[tuple[str, str], Account] = {}
        self._prices: dict[str, dict[str, ModelPrice]] = {}
        self._base: dict[str, str] = {}

    def load(self, table: RoutingTable) -> None:
        """Take the leases and prices of ``table``; accounts of budgets it still has are kept."""
        accounts: dict[tuple[str, str], Account] = {}
        prices: dict[str, dict[str, ModelPrice]] = {}
        for policy in table.tenants or ():
            budget = policy.budget
            if budget is None:
                continue
            for key, scope in budget.scopes():
                account = self._accounts.get((policy.tenant, key))
                if account is None:
                    account = Account(scope, self.edge)
                else:
                    account.update(scope, self.edge)
                accounts[(policy.tenant, key)] = account
            prices[policy.tenant] = {**table.prices, **budget.prices}
        self._accounts = accounts
        self._prices = prices
        # An adapter is priced as its base model, also while its deployment is cold (a
        # loadable adapter alone in the cold list is priced by name: the table's prices).
        base = {a: c.model for c in table.cold_models for a in c.adapters}
        base.update((a, i.model) for i in table.instances for a in (i.model, *i.adapters))
        self._base = base

    def reserve(
        self,
        tenant: str,
        key_prefix: str | None,
        model: str,
        prompt_tokens: int,
        output_tokens: int,
    ) -> Hold | None:
        """Hold the worst case of a request on its tenant's (and key's) budget; None when
        neither has one. :class:`EdgeError` when a budget is spent or this edge's slice of
        it cannot take the request."""
        prices = self._prices.get(tenant)
        if prices is None:
            return None
        accounts = [
            account
            for key in ("", key_prefix)
            if key is not None and (account := self._accounts.get((tenant, key))) is not None
        ]
        if not accounts:
            return None
        price = prices.get(self._base.get(model, model), FREE)
        worst = request_pusd(
            price, prompt_tokens=prompt_tokens, cached_tokens=0, completion_tokens=output_tokens
        )
        for account in accounts:
            _check(account, tenant, worst)
        for account in accounts:
            account.held += worst
        return Hold(tuple(accounts), worst, prices)

    def settle(
        self, hold: Hold, model: str | None, prompt: int, cached: int, completion: int
    ) -> int:
        """Release ``hold``; when this edge served the request (``model``: the base model
        that did), add its price to the spend. Its price, pico-USD."""
        spent = 0
        if model is not None:
            spent = request_pusd(
                hold.prices.get(model, FREE),
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
            )
        for account in hold.accounts:
            account.held -= hold.amount
            account.spent += spent
        return spent

    def release(self, hold: Hold) -> None:
        """Release ``hold`` of a request this edge did not serve."""
        self.settle(hold, None, 0, 0, 0)

    def report(self) -> list[dict[str, Any]]:
        """What this edge has committed of each budget (settled + held) where that is more
        than the control plane counted: the heartbeat's ``budgets``, from which the control
        plane may take back what an edge was granted and does not use (ADR 0008). A budget
        left out has nothing committed beyond its count."""
        return [
            {"tenant": tenant, "key": key, "committed": account.spent + account.held}
            for (tenant, key), account in self._accounts.items()
            if account.lease is not None and account.spent + account.held > account.counted
        ]

    def account(self, tenant: str, key_prefix: str = "") -> Account | None:
        """The account of a budget (for the operator's view and for tests)."""
        return self._accounts.get((tenant, key_prefix))


def _check(account: Account, tenant: str, worst: int) -> None:
    if account.state == "exhausted":
        raise EdgeError(
            403,
            f"Tenant {tenant!r} (or this API key) has exhausted its monthly budget; "
            "raise the budget or wait for the next month.",
            "budget_exhausted",
        )
    if account.room() < worst:
        raise EdgeError(
            429,
            f"This edge's share of tenant {tenant!r}'s remaining monthly budget cannot take "
            "this request's worst-case price now; the share is renewed as spend is counted. "
            "Retry shortly (a smaller max_tokens needs less).",
            "budget_lease_exhausted",
            retry_after=LEASE_RETRY_AFTER_S,
        )
