"""What one change costs the compiler: the demand split solved in independent blocks (one per
base model) and remembered by its inputs, the tenants planned, encoded and digested once for
every region and reused by the next compile, and only the regions whose body changed
published."""

from __future__ import annotations

import dataclasses

import pytest

from federation.routing import demand
from federation.routing.changed_tables import compile_changed_tables
from federation.routing.compiler import compile_fleet_tables
from federation.routing.demand import Offer, split_shared_demand
from federation.routing.digest import body_hash, section_digest
from federation.routing.snapshot import FleetSnapshot
from tests.unit.test_routing_tables import M70, SNAPSHOT, _inst

RTT = {("us", "eu"): 75.0, ("eu", "us"): 75.0}
SHARES = {"us": {"any": 1.0}, "eu": {"any": 1.0}}
ALLOWED = {"any": frozenset({"us", "eu"})}
GENERATED_AT = "2026-11-29T10:00:00Z"


def _split(capacity_a: float) -> demand.DemandSplit:
    """Two base models and an adapter of the first: "a" is short of capacity in us."""
    return split_shared_demand(
        demand={("us", "a"): 900.0, ("us", "a-lora"): 100.0, ("eu", "b"): 400.0},
        class_shares=SHARES,
        allowed=ALLOWED,
        offers={
            "a": {"us": Offer(0.10, "a"), "eu": Offer(0.12, "a")},
            "a-lora": {"us": Offer(0.10, "a")},
            "b": {"us": Offer(0.05, "b"), "eu": Offer(0.20, "b")},
        },
        capacity={("us", "a"): capacity_a, ("eu", "a"): 5000.0, ("us", "b"): 5000.0},
        rtt_ms=RTT,
    )


def _count_solves(monkeypatch: pytest.MonkeyPatch) -> list[frozenset[str]]:
    """The models of each block the solver is asked to solve."""
    solved: list[frozenset[str]] = []
    real = demand._solve_block

    def counting(commodities, *args, **kwargs):  # type: ignore[no-untyped-def]
        solved.append(frozenset(model for _, model, _ in commodities))
        return real(commodities, *args, **kwargs)

    monkeypatch.setattr(demand, "_solve_block", counting)
    monkeypatch.setattr(demand, "_BLOCKS", demand._BlockMemo(64))
    return solved


def test_the_split_is_solved_per_base_model_and_an_adapter_shares_its_base_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    solved = _count_solves(monkeypatch)
    split = _split(capacity_a=600.0)
    assert sorted(solved, key=sorted) == [frozenset({"a", "a-lora"}), frozenset({"b"})]
    # The adapter's demand competes for its base's capacity in us: 600 of the 1,000 fit there,
    # the rest goes to eu, and "b" (its own block) goes to the cheaper us at once.
    assert split.load[("us", "a")] == pytest.approx(600.0)
    assert split.load[("eu", "a")] == pytest.approx(400.0)
    assert split.origin_fractions[("eu", "b")] == pytest.approx({"us": 1.0})
    assert split.origin_unserved == {}


def test_a_change_to_one_base_model_re_solves_only_its_block_with_the_same_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    solved = _count_solves(monkeypatch)
    first = _split(capacity_a=600.0)
    assert _split(capacity_a=600.0) == first  # remembered: nothing solved again
    assert len(solved) == 2
    changed = _split(capacity_a=800.0)
    assert solved[2:] == [frozenset({"a", "a-lora"})]
    assert changed.load[("us", "a")] == pytest.approx(800.0)
    assert changed.origin_fractions[("eu", "b")] == first.origin_fractions[("eu", "b")]
    # A fresh memo solves everything again, to the same answer.
    monkeypatch.setattr(demand, "_BLOCKS", demand._BlockMemo(64))
    assert _split(capacity_a=800.0) == changed


def test_the_block_memo_forgets_the_least_recently_used() -> None:
    memo = demand._BlockMemo(2)
    one, two, three = (demand._Solved({}, {}, {}, float(i), i) for i in range(3))
    memo.put(("one",), one)
    memo.put(("two",), two)
    assert memo.get(("one",)) is one  # now the most recent
    memo.put(("three",), three)
    assert memo.get(("two",)) is None and memo.get(("one",)) is one


def test_the_body_hash_digests_the_tenants_once_and_ignores_volatile_fields() -> None:
    versions = {r.code: 1 for r in SNAPSHOT.regions}
    doc = compile_fleet_tables(SNAPSHOT, versions=versions, generated_at=GENERATED_AT)["eu-west"]
    digest = section_digest(doc["tenants"])
    assert body_hash(doc) == body_hash(doc, tenants_digest=digest)
    later = {**doc, "version": 9, "generated_at": "2027-01-01T00:00:00Z"}
    assert body_hash(later) == body_hash(doc)
    fewer = {**doc, "tenants": doc["tenants"][1:]}
    assert body_hash(fewer) != body_hash(doc)


def test_one_instance_changing_publishes_only_what_changed_and_reuses_the_tenants() -> None:
    regions = [r.code for r in SNAPSHOT.regions]
    plan, first = compile_changed_tables(
        SNAPSHOT, latest={c: (0, None) for c in regions}, generated_at=GENERATED_AT
    )
    assert sorted(t.region for t in first) == sorted(regions)
    assert all(t.document["version"] == 1 for t in first)
    latest = {t.region: (1, t.body_hash) for t in first}

    # Nothing changed: nothing to publish, and the tenants' part is the previous one.
    again, none = compile_changed_tables(
        SNAPSHOT, latest=latest, generated_at="2026-11-29T10:05:00Z", reuse=plan.tenant_plan
    )
    assert none == [] and again.tenant_plan is plan.tenant_plan

    # A second 70B replica in us-east: us-east's own table lists it; the tenants are reused
    # (encoded and digested once, by the first compile).
    grown = dataclasses.replace(
        SNAPSHOT,
        instances=(*SNAPSHOT.instances, _inst("us-71", "us-east", model=M70, tp=4, params=70.0)),
    )
    after, changed = compile_changed_tables(
        grown, latest=latest, generated_at=GENERATED_AT, reuse=plan.tenant_plan
    )
    assert after.tenant_plan is plan.tenant_plan
    by_region = {t.region: t for t in changed}
    assert "us-east" in by_region
    us = by_region["us-east"]
    assert us.document["version"] == 2
    assert "us-71" in {i["id"] for i in us.document["instances"]}
    assert us.document["tenants"] is plan.tenant_plan.documents()
    assert us.body_hash == body_hash(us.document)
    # Every region it did not list is one whose body is the same as before.
    fresh = compile_fleet_tables(grown, versions=dict.fromkeys(regions, 2), generated_at="x")
    for code in set(regions) - set(by_region):
        assert body_hash(fresh[code]) == latest[code][1]


def test_a_tenant_change_is_not_hidden_by_the_reused_plan() -> None:
    regions = [r.code for r in SNAPSHOT.regions]
    plan, first = compile_changed_tables(
        SNAPSHOT, latest={c: (0, None) for c in regions}, generated_at=GENERATED_AT
    )
    latest = {t.region: (1, t.body_hash) for t in first}
    fewer = FleetSnapshot(
        regions=SNAPSHOT.regions,
        instances=SNAPSHOT.instances,
        rtt_ms=SNAPSHOT.rtt_ms,
        tenants=SNAPSHOT.tenants[1:],
    )
    after, changed = compile_changed_tables(
        fewer, latest=latest, generated_at=GENERATED_AT, reuse=plan.tenant_plan
    )
    assert after.tenant_plan is not plan.tenant_plan
    assert sorted(t.region for t in changed) == sorted(regions)  # every table lists tenants
    assert all(len(t.document["tenants"]) == len(SNAPSHOT.tenants) - 1 for t in changed)


def test_a_compile_runs_without_the_cyclic_collector_and_leaves_it_as_it_found_it() -> None:
    import gc

    from federation.routing.services import without_cyclic_gc

    assert gc.isenabled()
    with without_cyclic_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # someone else's choice is kept
    try:
        with without_cyclic_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), without_cyclic_gc():
        raise RuntimeError("a failed compile")
    assert gc.isenabled()
