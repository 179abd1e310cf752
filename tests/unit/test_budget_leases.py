"""Budget leases, both halves: the control plane's split (``federation/routing/leases.py``)
and the edge's accounts (``regions/edge/policy/budget.py``). The property: however requests
interleave with ingestion and re-leasing, what is spent never exceeds the budget when no
request costs more than the worst case its edge held."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from federation.routing.leases import (
    BudgetRow,
    KeyBudget,
    Published,
    budget_leases,
    published_leases,
    split_grant,
    tenant_budget,
)
from regions.edge.http.errors import EdgeError
from regions.edge.policy.budget import Budgets
from regions.tables.money import request_pusd
from regions.tables.schema import (
    BUDGET_SCHEMA_VERSION,
    Instance,
    Lease,
    ModelPrice,
    RoutingTable,
    TenantBudget,
    TenantPolicy,
    decode_table,
)

PRICE = ModelPrice(input=1_000_000, cached_input=500_000, output=4_000_000)  # $1/$0.5/$4


def table(budget: TenantBudget, version: int = 1) -> RoutingTable:
    return RoutingTable(
        schema_version=BUDGET_SCHEMA_VERSION,
        version=version,
        region="r",
        generated_at="2026-12-01T00:00:00Z",
        instances=(Instance(id="i", url="http://i:1", model="m", adapters=("m-lora",)),),
        tenants=(TenantPolicy(tenant="acme", budget=budget),),
        prices={"m": PRICE},
    )


def leased(
    budget: int,
    counted: dict[tuple[str, str], int],
    edges: list[str],
    published: dict[tuple[str, str], Published] | None = None,
    committed: dict[tuple[str, str], int] | None = None,
) -> TenantBudget:
    row = BudgetRow(
        month="2026-12",
        budget=budget,
        counted=counted,
        published=published or {},
        committed=committed or {},
    )
    return tenant_budget(row, edges)


def test_a_grant_is_split_half_evenly_half_by_spend() -> None:
    assert split_grant(1000, {}, ["a", "b"]) == [500, 500]
    # a served three quarters of the spend: 1/4 + 3/8 of the grant.
    assert split_grant(1000, {"a": 300, "b": 100}, ["a", "b"]) == [625, 375]
    assert split_grant(0, {"a": 1}, ["a"]) == [0]
    assert split_grant(-5, {}, ["a"]) == [0]
    assert split_grant(10, {}, []) == []


@given(
    grant=st.integers(0, 10**18),
    spent=st.lists(st.integers(0, 10**15), min_size=1, max_size=6),
)
def test_slices_never_add_up_to_more_than_the_grant(grant: int, spent: list[int]) -> None:
    edges = [f"e{i}" for i in range(len(spent))]
    slices = split_grant(grant, dict(zip(edges, spent, strict=True)), edges)
    assert all(s >= 0 for s in slices)
    assert grant - len(edges) <= sum(slices) <= grant


def ceilings(budget: object) -> dict[str, tuple[int, int]]:
    """edge -> (ceiling, prior)."""
    return {e: (x.counted + x.lease, x.prior) for e, x in budget.leases.items()}  # type: ignore[attr-defined]


def test_a_ceiling_is_lowered_only_after_its_edge_reported_on_it_and_freed_a_compile_later() -> (
    None
):
    first = budget_leases("2026-12", 1000, {}, ["a", "b"])
    assert ceilings(first) == {"a": (250, 0), "b": (250, 0)}  # half of it, evenly
    published = {e: Published(0, 250, 0) for e in "ab"}
    # a served 200 (counted); neither has reported on the table yet: nobody's ceiling drops.
    second = budget_leases("2026-12", 1000, {"a": 200}, ["a", "b"], published)
    assert ceilings(second) == {"a": (250 + 187, 250), "b": (250 + 62, 250)}
    # b reports on that table, having committed nothing: its ceiling drops to half of it plus
    # its share, yet what it may hold until it applies the next table (312) is still kept from
    # the others.
    published = {"a": Published(200, 437, 250), "b": Published(0, 312, 250)}
    third = budget_leases("2026-12", 1000, {"a": 200}, ["a", "b"], published, {"b": 0})
    a3, b3 = ceilings(third)["a"], ceilings(third)["b"]
    free = 1000 - 437 - 312
    assert b3 == (312 // 2 + free // 2 * 200 // (2 * 2 * 200), 312)
    assert a3[0] + max(b3) <= 1000
    # Another compile before b applied that table: b may still spend under 312, so nobody
    # else is granted any of it yet.
    published = {"a": Published(200, a3[0], a3[1]), "b": Published(0, b3[0], b3[1])}
    again = budget_leases("2026-12", 1000, {"a": 200}, ["a", "b"], published)
    assert ceilings(again)["b"][1] == 312 <= ceilings(again)["b"][0]
    assert sum(max(c) for c in ceilings(again).values()) <= 1000
    # b applied it and reports again: what it gave back is free; most of it goes to a, which
    # has the spend (a reported too: its ceiling is now what it committed plus half of what it
    # left unused, plus its share).
    published = {"a": Published(200, a3[0], a3[1]), "b": Published(0, b3[0], b3[1])}
    fourth = budget_leases("2026-12", 1000, {"a": 200}, ["a", "b"], published, {"a": 200, "b": 0})
    a4, b4 = ceilings(fourth)["a"], ceilings(fourth)["b"]
    assert b4[1] == b3[0]  # b holds only its lowered ceiling now
    free = 1000 - a3[0] - b3[0]
    assert a4[0] == 200 + (a3[0] - 200) // 2 + free // 2 * (200 + 2 * 200) // (2 * 2 * 200)
    assert max(a4) + max(b4) <= 1000


def test_edges_that_all_report_when_the_budget_is_held_keep_room_to_serve() -> None:
    """Three edges whose ceilings hold the whole budget report at once, having used little: a
    take-back of all they left unused would leave each at what it committed (nothing is free to
    grant), refusing every request until a later compile. Each keeps half of its slack."""
    third = 1000 // 3
    published = {e: Published(10, third, 0) for e in "abc"}
    counted = {e: 10 for e in "abc"}
    found = budget_leases(
        "2026-12", 1000, counted, ["a", "b", "c"], published, {e: 10 for e in "abc"}
    )
    for edge in "abc":
        ceiling, held = ceilings(found)[edge]
        assert held == third
        assert ceiling - 10 >= (third - 10) // 2  # room to serve, not zero
    assert sum(max(c) for c in ceilings(found).values()) <= 1000


def test_an_edge_gone_quiet_keeps_its_ceiling_and_the_state_follows_counted_spend() -> None:
    third = budget_leases(
        "2026-12", 1000, {"a": 600, "gone": 250}, ["a"], {"gone": Published(250, 300, 0)}
    )
    assert third.state == "warn"  # 850 of 1000
    assert ceilings(third)["gone"] == (300, 300)
    assert ceilings(third)["a"][0] == 600 + 50  # half of the 100 nobody holds
    assert budget_leases("2026-12", 1000, {"a": 1000}, ["a"]).state == "exhausted"


def test_an_edge_holds_the_worst_case_and_spends_the_real_price() -> None:
    budgets = Budgets("a")
    budgets.load(table(leased(2 * 10**9, {}, ["a"])))
    hold = budgets.reserve("acme", None, "m-lora", prompt_tokens=100, output_tokens=100)
    assert hold is not None
    worst = request_pusd(PRICE, prompt_tokens=100, cached_tokens=0, completion_tokens=100)
    assert hold.amount == worst == 500_000_000
    account = budgets.account("acme")
    assert account is not None and account.held == worst
    spent = budgets.settle(hold, "m", prompt=100, cached=50, completion=20)
    assert spent == 50 * 1_000_000 + 50 * 500_000 + 20 * 4_000_000
    assert (account.held, account.spent) == (0, spent)


def test_past_its_lease_an_edge_refuses_with_retry_after_and_at_the_budget_for_good() -> None:
    budgets = Budgets("a")
    budgets.load(table(leased(2_000_000_000, {}, ["a", "b"])))  # a quarter: one request
    budgets.reserve("acme", None, "m", prompt_tokens=100, output_tokens=100)
    with pytest.raises(EdgeError) as refused:
        budgets.reserve("acme", None, "m", prompt_tokens=100, output_tokens=100)
    assert (refused.value.status, refused.value.code) == (429, "budget_lease_exhausted")
    assert refused.value.retry_after
    # A smaller request fits what is left of the slice.
    budgets.reserve("acme", None, "m", prompt_tokens=0, output_tokens=0)

    budgets.load(table(leased(1000, {("", "b"): 1000}, ["a", "b"]), version=2))
    with pytest.raises(EdgeError) as exhausted:
        budgets.reserve("acme", None, "m", prompt_tokens=1, output_tokens=1)
    assert (exhausted.value.status, exhausted.value.code) == (403, "budget_exhausted")


def test_an_edge_without_a_lease_serves_none_of_the_budget() -> None:
    budgets = Budgets("new-edge")
    budgets.load(table(leased(10**12, {}, ["a"])))
    with pytest.raises(EdgeError):
        budgets.reserve("acme", None, "m", prompt_tokens=1, output_tokens=1)
    assert Budgets("x").reserve("other", None, "m", prompt_tokens=1, output_tokens=1) is None


def test_a_key_with_its_own_budget_is_held_on_both() -> None:
    row = BudgetRow(
        month="2026-12", budget=10**12, key_budgets=[KeyBudget(18 * 10**8, ("fi_Key00001",))]
    )
    budgets = Budgets("a")
    budgets.load(table(tenant_budget(row, ["a"])))
    hold = budgets.reserve("acme", "fi_Key00001", "m", prompt_tokens=100, output_tokens=100)
    assert hold is not None and len(hold.accounts) == 2
    with pytest.raises(EdgeError):  # the key's budget (9 x 10^8) holds one
        budgets.reserve("acme", "fi_Key00001", "m", prompt_tokens=100, output_tokens=100)
    # Another key of the tenant is held on the tenant's budget only.
    assert budgets.reserve("acme", "fi_Other001", "m", prompt_tokens=100, output_tokens=100)


def test_a_rotated_key_keeps_its_months_spend_and_its_budget() -> None:
    """Spend counted under the prefix a rotation replaced is the key's: the new prefix gets
    only what remains, and the state is the key's, not the new prefix's."""
    key = KeyBudget(10**9, live=("fi_New00001",), prefixes=("fi_Old00001", "fi_New00001"))
    counted = {("fi_Old00001", "a"): 8 * 10**8, ("fi_Other01", "a"): 5 * 10**8}
    row = BudgetRow(month="2026-12", budget=None, counted=counted, key_budgets=[key])
    found = tenant_budget(row, ["a"])
    assert found.tenant is None
    assert list(found.keys) == ["fi_New00001"]
    new = found.keys["fi_New00001"]
    assert new.state == "warn"  # 80 % of the key's budget, all of it under the old prefix
    # Half of what remains (2 x 10^8) is granted; another key's spend does not count.
    assert new.leases == {"a": Lease(counted=0, lease=10**8, prior=0)}
    spent = BudgetRow(
        month="2026-12",
        budget=None,
        counted={("fi_Old00001", "a"): 10**9},
        key_budgets=[key],
    )
    assert tenant_budget(spent, ["a"]).keys["fi_New00001"].state == "exhausted"


def test_both_secrets_of_a_key_in_rotation_grace_share_its_one_budget() -> None:
    """During a rotation's grace both prefixes are leased, per edge, from the one budget: the
    ceilings of both at every edge add up to at most the budget, across compiles."""
    key = KeyBudget(10**9, live=("fi_New00001", "fi_Old00001"))
    edges = ["a", "b"]
    published: dict[tuple[str, str], Published] = {}
    for _ in range(6):
        row = BudgetRow(month="2026-12", budget=None, key_budgets=[key], published=published)
        found = tenant_budget(row, edges)
        assert set(found.keys) == {"fi_New00001", "fi_Old00001"}
        published = {
            (prefix, edge): Published(lease.counted, lease.counted + lease.lease, lease.prior)
            for prefix, budget in found.keys.items()
            for edge, lease in budget.leases.items()
        }
        assert len(published) == 4
        assert sum(max(p.ceiling, p.prior) for p in published.values()) <= 10**9
    # Once the grace is over only the new prefix is leased; the old one's ceiling stays held
    # for one more compile (its edge may still be spending under it).
    after = BudgetRow(
        month="2026-12",
        budget=None,
        key_budgets=[KeyBudget(10**9, ("fi_New00001",), ("fi_New00001", "fi_Old00001"))],
        published=published,
    )
    found = tenant_budget(after, edges)
    assert list(found.keys) == ["fi_New00001"]
    held_old = sum(p.ceiling for (prefix, _), p in published.items() if prefix == "fi_Old00001")
    new_ceilings = sum(lease.lease for lease in found.keys["fi_New00001"].leases.values())
    assert held_old > 0 and held_old + new_ceilings <= 10**9


def test_counted_spend_moves_from_uncounted_to_counted_and_a_new_month_starts_afresh() -> None:
    budgets = Budgets("a")
    budgets.load(table(leased(10**12, {}, ["a"])))
    hold = budgets.reserve("acme", None, "m", prompt_tokens=10, output_tokens=10)
    assert hold is not None
    budgets.settle(hold, "m", prompt=10, cached=0, completion=10)
    account = budgets.account("acme")
    assert account is not None
    uncounted = account.spent - account.counted
    assert uncounted == 50_000_000
    # The control plane counted it: spent stays, counted catches up, nothing is forgotten;
    # the ceiling (counted + lease) never goes down.
    ceiling = account.counted + (account.lease or 0)
    counted = {("", "a"): 50_000_000}
    published = {("", "a"): Published(0, ceiling)}
    budgets.load(table(leased(10**12, counted, ["a"], published), version=2))
    assert account.spent - account.counted == 0
    assert account.counted + (account.lease or 0) >= ceiling
    row = BudgetRow(month="2027-01", budget=10**12)
    budgets.load(table(tenant_budget(row, ["a"]), version=3))
    assert (account.spent, account.counted, account.lease) == (0, 0, 10**12 // 2)


def test_a_budgeted_table_round_trips_through_the_contract() -> None:
    import msgspec

    from regions.tables.schema import encode_table

    doc = table(leased(10**12, {("", "a"): 7}, ["a", "b"]))
    decoded = decode_table(msgspec.json.encode(encode_table(doc)))
    assert decoded == doc
    old = msgspec.structs.replace(doc, schema_version=2)
    with pytest.raises(ValueError, match="needs schema_version 3"):
        decode_table(msgspec.json.encode(encode_table(old)))


# --- the protocol as a whole ---------------------------------------------------------------

request = st.tuples(
    st.integers(0, 2),  # edge
    st.integers(0, 200),  # prompt tokens (the edge's estimate: the engine's count, here)
    st.integers(0, 100),  # max_tokens
    st.floats(0, 1),  # share of max_tokens it generates
)
step = st.one_of(
    st.tuples(st.just("request"), request),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("ingest"), st.integers(0, 50)),
    st.tuples(st.just("apply"), st.integers(0, 2)),
    st.tuples(st.just("report"), st.integers(0, 2)),
    st.just(("release", None)),
)


@settings(max_examples=500, deadline=None)
@given(budget=st.integers(0, 3 * 10**9), steps=st.lists(step, min_size=30, max_size=150))
def test_spend_never_exceeds_the_budget_whatever_the_interleaving(
    budget: int, steps: list[tuple[str, object]]
) -> None:
    """Edges admit and finish requests, apply new tables late and report what they committed;
    the control plane counts some finished requests and re-leases — in any order: the money
    spent (finished, and running at its real price) never exceeds the budget."""
    edges = ["a", "b", "c"]
    live = {e: Budgets(e) for e in edges}
    counted: dict[tuple[str, str], int] = {}
    tables: list[RoutingTable] = []
    applied = dict.fromkeys(edges, 0)  # index into tables
    reports: dict[str, tuple[int, int]] = {}  # edge -> (table index, committed)

    def release() -> None:
        published: dict[tuple[str, str], Published] = {}
        committed: dict[tuple[str, str], int] = {}
        if tables:
            published = published_leases(tables[-1].tenants or (), "2026-12").get("acme", {})
            for edge, (at, amount) in reports.items():
                if at == len(tables) - 1:
                    committed[("", edge)] = amount
        doc = table(leased(budget, counted, edges, published, committed), len(tables) + 1)
        tables.append(doc)

    def apply(edge: str) -> None:
        applied[edge] = len(tables) - 1
        live[edge].load(tables[-1])

    release()
    for edge in edges:
        apply(edge)
    running: list[tuple[str, object, int, int]] = []
    finished: list[tuple[str, int]] = []  # (edge, price) not counted yet
    spent = 0
    for kind, arg in steps:
        if kind == "request":
            e, prompt, max_tokens, share = arg  # type: ignore[misc]
            edge = edges[e]
            try:
                hold = live[edge].reserve("acme", None, "m", prompt, max_tokens)
            except EdgeError:
                continue
            running.append((edge, hold, prompt, int(max_tokens * share)))
        elif kind == "finish" and running:
            edge, hold, prompt, completion = running.pop(int(arg) % len(running))  # type: ignore[call-overload]
            price = live[edge].settle(hold, "m", prompt, 0, completion)  # type: ignore[arg-type]
            spent += price
            finished.append((edge, price))
        elif kind == "ingest" and finished:
            edge, price = finished.pop(int(arg) % len(finished))  # type: ignore[call-overload]
            counted[("", edge)] = counted.get(("", edge), 0) + price
        elif kind == "apply":
            apply(edges[int(arg)])  # type: ignore[call-overload]
        elif kind == "report":
            edge = edges[int(arg)]  # type: ignore[call-overload]
            account = live[edge].account("acme")
            assert account is not None
            reported = {(r["tenant"], r["key"]): r["committed"] for r in live[edge].report()}
            reports[edge] = (applied[edge], reported.get(("acme", ""), account.counted))
        elif kind == "release":
            release()
        in_flight = sum(
            request_pusd(PRICE, prompt_tokens=p, cached_tokens=0, completion_tokens=c)
            for _, _, p, c in running
        )
        assert spent + in_flight <= budget


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b["tenant"].update(month="2026-13"), "is not YYYY-MM"),
        (lambda b: b["tenant"]["leases"].update(a=[0, -1, 0]), "negative"),
        (lambda b: b.update(prices={"m": [1, -2, 3]}), "must not be negative"),
    ],
)
def test_a_table_with_a_bad_budget_is_refused(mutate: Any, message: str) -> None:
    import msgspec

    from regions.tables.schema import encode_table

    doc = encode_table(table(leased(10**12, {}, ["a"])))
    mutate(doc["tenants"][0]["budget"])
    with pytest.raises(ValueError, match=message):
        decode_table(msgspec.json.encode(doc))
