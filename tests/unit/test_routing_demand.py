"""The demand split: cheapest-and-near first, capacity and residency never violated, and
demand nobody may take reported rather than hidden."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from federation.routing.demand import Offer, split_demand, split_shared_demand

RTT = {
    ("us", "eu"): 75.0,
    ("eu", "us"): 75.0,
    ("us", "ap"): 220.0,
    ("ap", "us"): 220.0,
    ("eu", "ap"): 160.0,
    ("ap", "eu"): 160.0,
}
ANY = frozenset({"us", "eu", "ap"})


def _offers(**costs: float) -> dict[str, dict[str, Offer]]:
    return {"m": {region: Offer(cost, "m") for region, cost in costs.items()}}


def test_local_wins_when_prices_are_equal_and_capacity_suffices() -> None:
    split = split_demand(
        demand={("any", "us", "m"): 100.0},
        allowed={"any": ANY},
        offers=_offers(us=0.1, eu=0.1, ap=0.1),
        capacity={("us", "m"): 1000.0, ("eu", "m"): 1000.0, ("ap", "m"): 1000.0},
        rtt_ms=RTT,
    )
    assert split.fractions[("any", "us", "m")] == pytest.approx({"us": 1.0})
    assert split.unserved == {}
    assert split.load == pytest.approx({("us", "m"): 100.0})


def test_a_much_cheaper_near_region_takes_the_traffic_a_far_one_does_not() -> None:
    # eu is 0.05 cheaper: worth 75 ms (0.015 penalty); ap is 0.06 cheaper but 220 ms away
    # (0.044 penalty), so its net saving (0.016) is smaller than eu's (0.035).
    split = split_demand(
        demand={("any", "us", "m"): 100.0},
        allowed={"any": ANY},
        offers=_offers(us=0.10, eu=0.05, ap=0.04),
        capacity={("us", "m"): 1000.0, ("eu", "m"): 1000.0, ("ap", "m"): 1000.0},
        rtt_ms=RTT,
    )
    assert split.fractions[("any", "us", "m")] == pytest.approx({"eu": 1.0})
    # With a larger latency penalty the local region keeps it.
    split = split_demand(
        demand={("any", "us", "m"): 100.0},
        allowed={"any": ANY},
        offers=_offers(us=0.10, eu=0.05, ap=0.04),
        capacity={("us", "m"): 1000.0, ("eu", "m"): 1000.0, ("ap", "m"): 1000.0},
        rtt_ms=RTT,
        latency_penalty=0.01,
    )
    assert split.fractions[("any", "us", "m")] == pytest.approx({"us": 1.0})


def test_capacity_spills_the_excess_to_the_next_best_region() -> None:
    split = split_demand(
        demand={("any", "us", "m"): 1000.0},
        allowed={"any": ANY},
        offers=_offers(us=0.1, eu=0.1, ap=0.1),
        capacity={("us", "m"): 600.0, ("eu", "m"): 300.0, ("ap", "m"): 1000.0},
        rtt_ms=RTT,
    )
    assert split.fractions[("any", "us", "m")] == pytest.approx({"us": 0.6, "eu": 0.3, "ap": 0.1})


def test_residency_is_hard_and_the_remainder_is_reported_unserved() -> None:
    # EU-only demand arrives in us; eu has room for half of it; us and ap are idle but banned.
    split = split_demand(
        demand={("eu-only", "us", "m"): 400.0, ("any", "us", "m"): 100.0},
        allowed={"eu-only": frozenset({"eu"}), "any": ANY},
        offers=_offers(us=0.1, eu=0.5, ap=0.1),
        capacity={("us", "m"): 1e6, ("eu", "m"): 200.0, ("ap", "m"): 1e6},
        rtt_ms=RTT,
    )
    assert split.fractions[("eu-only", "us", "m")] == pytest.approx({"eu": 0.5})
    assert split.unserved == pytest.approx({("eu-only", "us", "m"): 200.0})
    assert split.fractions[("any", "us", "m")] == pytest.approx({"us": 1.0})


def test_demand_with_no_allowed_reachable_region_is_unserved_without_a_variable() -> None:
    split = split_demand(
        demand={("eu-only", "us", "m"): 50.0},
        allowed={"eu-only": frozenset({"eu"})},
        offers=_offers(us=0.1),
        capacity={("us", "m"): 1e6},
        rtt_ms=RTT,
    )
    assert split.fractions == {} and split.unserved == {("eu-only", "us", "m"): 50.0}
    assert split.variables == 0


def test_an_unreachable_region_is_not_a_target() -> None:
    split = split_demand(
        demand={("any", "us", "m"): 10.0},
        allowed={"any": ANY},
        offers=_offers(ap=0.1),
        capacity={("ap", "m"): 1e6},
        rtt_ms={("us", "eu"): 75.0},  # no us->ap link
    )
    assert split.unserved == {("any", "us", "m"): 10.0}


def test_adapters_share_their_base_models_capacity() -> None:
    offers = {
        "m": {"us": Offer(0.1, "m"), "eu": Offer(0.2, "m")},
        "m-sql": {"us": Offer(0.1, "m")},
    }
    split = split_demand(
        demand={("any", "us", "m"): 80.0, ("any", "us", "m-sql"): 80.0},
        allowed={"any": ANY},
        offers=offers,
        capacity={("us", "m"): 100.0, ("eu", "m"): 1000.0},
        rtt_ms=RTT,
    )
    # The adapter can only run in us, so the base model gives way to it.
    assert split.fractions[("any", "us", "m-sql")] == pytest.approx({"us": 1.0})
    assert split.fractions[("any", "us", "m")] == pytest.approx({"us": 0.25, "eu": 0.75})
    assert split.load[("us", "m")] == pytest.approx(100.0)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="negative demand"):
        split_demand(
            demand={("a", "us", "m"): -1.0}, allowed={"a": ANY}, offers={}, capacity={}, rtt_ms={}
        )
    with pytest.raises(KeyError, match="unknown residency class"):
        split_demand(
            demand={("b", "us", "m"): 1.0}, allowed={"a": ANY}, offers={}, capacity={}, rtt_ms={}
        )


REGIONS = ("us", "eu", "ap", "sa")


@st.composite
def problems(draw: st.DrawFn) -> dict:
    classes = {
        f"c{i}": frozenset(draw(st.sets(st.sampled_from(REGIONS), max_size=4)))
        for i in range(draw(st.integers(1, 4)))
    }
    models = [f"m{i}" for i in range(draw(st.integers(1, 3)))]
    offers = {
        m: {
            s: Offer(draw(st.floats(0.01, 2.0)), m)
            for s in draw(st.sets(st.sampled_from(REGIONS), min_size=1))
        }
        for m in models
    }
    capacity = {(s, m): draw(st.floats(0.0, 500.0)) for m in models for s in offers[m]}
    demand = {
        (c, o, m): draw(st.floats(0.0, 400.0))
        for c in classes
        for o in REGIONS
        for m in models
        if draw(st.booleans())
    }
    rtt = {
        (a, b): draw(st.floats(1.0, 300.0))
        for a in REGIONS
        for b in REGIONS
        if a != b and draw(st.integers(0, 4)) > 0
    }
    return {
        "demand": demand,
        "allowed": classes,
        "offers": offers,
        "capacity": capacity,
        "rtt_ms": rtt,
    }


@settings(max_examples=60, deadline=None)
@given(problems())
def test_property_residency_capacity_and_conservation(problem: dict) -> None:
    split = split_demand(**problem)
    load: dict[tuple[str, str], float] = {}
    for key, d in problem["demand"].items():
        cls, origin, model = key
        fractions = split.fractions.get(key, {})
        # Residency: never a region outside the class's allowed set, never an unreachable one.
        assert set(fractions) <= problem["allowed"][cls]
        assert all(s == origin or (origin, s) in problem["rtt_ms"] for s in fractions)
        assert all(x >= -1e-9 for x in fractions.values())
        # Conservation: served shares plus the reported unserved demand make the whole.
        if d > 0:
            served = sum(fractions.values()) * d
            assert served + split.unserved.get(key, 0.0) == pytest.approx(d, rel=1e-6, abs=1e-6)
        for s, x in fractions.items():
            load[(s, model)] = load.get((s, model), 0.0) + x * d
    for key, used in load.items():
        assert used <= problem["capacity"][key] * (1 + 1e-6) + 1e-6


@settings(max_examples=40, deadline=None)
@given(problems(), st.data())
def test_property_shared_demand_solves_the_same_programme(
    problem: dict, data: st.DataObject
) -> None:
    classes = sorted(problem["allowed"])
    weights = [data.draw(st.floats(0.1, 1.0)) for _ in classes]
    shares = {c: w / sum(weights) for c, w in zip(classes, weights, strict=True)}
    per_origin: dict[tuple[str, str], float] = {}
    for (_, o, m), d in problem["demand"].items():
        per_origin[(o, m)] = per_origin.get((o, m), 0.0) + d
    shared = split_shared_demand(
        demand=per_origin,
        class_shares={o: shares for o, _ in per_origin},
        allowed=problem["allowed"],
        offers=problem["offers"],
        capacity=problem["capacity"],
        rtt_ms=problem["rtt_ms"],
    )
    explicit = split_demand(
        demand={(c, o, m): d * shares[c] for (o, m), d in per_origin.items() for c in classes},
        allowed=problem["allowed"],
        offers=problem["offers"],
        capacity=problem["capacity"],
        rtt_ms=problem["rtt_ms"],
    )
    assert shared.objective == pytest.approx(explicit.objective, rel=1e-6, abs=1e-6)
    for key, d in per_origin.items():
        if d > 0:
            served = sum(shared.origin_fractions.get(key, {}).values()) * d
            unserved = shared.origin_unserved.get(key, 0.0)
            assert served + unserved == pytest.approx(d, rel=1e-6, abs=1e-6)
