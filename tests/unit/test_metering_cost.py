"""The pool-hour cost split: every pool's hour is accounted for to 1e-12 USD — allocated to
the usage it served by engine time, or unallocated as idle GPUs, warm idle instances or the
re-prefills of continued streams (the operator's)."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from federation.metering.cost import (
    QUANTUM,
    InstanceHour,
    pool_hour_cost,
    reprefill_by_instance,
    split_exactly,
    whole_hour,
)


def test_a_split_is_exact_and_proportional() -> None:
    shares = split_exactly(Decimal("1.000000000000"), {"a": 1.0, "b": 1.0, "c": 1.0})
    assert sum(shares.values()) == Decimal(1)
    assert sorted(shares.values()) == [Decimal("0.333333333333")] * 2 + [Decimal("0.333333333334")]
    assert split_exactly(Decimal(10), {"x": 3.0, "y": 1.0}) == {
        "x": Decimal("7.5"),
        "y": Decimal("2.5"),
    }


def test_engine_time_weighs_fresh_prompt_and_generated_tokens_at_the_instances_speed() -> None:
    inst = InstanceHour(
        "us-1",
        gpus=2,
        prefill_tokens_per_s=10_000,
        decode_tokens_per_s=1_000,
        usage={"acme": (10_000, 0), "globex": (0, 3_000)},
    )
    cost = pool_hour_cost(spans=whole_hour(8, Decimal("2.50")), instances=[inst])
    assert cost.cost == Decimal(20)
    assert cost.idle == Decimal(15)  # 6 of 8 GPUs run no instance
    assert cost.allocated == {"acme": Decimal("1.25"), "globex": Decimal("3.75")}
    assert cost.busy_s == pytest.approx(4.0)


def test_an_instance_that_served_nothing_is_warm_idle() -> None:
    busy = InstanceHour("a", 1, 10_000, 1_000, {"acme": (100, 100)})
    quiet = InstanceHour("b", 1, 10_000, 1_000, {"globex": (0, 0)})
    cost = pool_hour_cost(spans=whole_hour(2, Decimal("3")), instances=[busy, quiet])
    assert cost.allocated == {"acme": Decimal(3)}
    assert cost.warm_idle == Decimal(3)
    assert cost.idle == 0


def test_instances_replaced_within_the_hour_share_the_pool_with_nothing_idle() -> None:
    old = InstanceHour("old", 2, 1.0, 1.0, {"acme": (1, 0)})
    new = InstanceHour("new", 2, 1.0, 1.0, {"acme": (1, 0)})
    cost = pool_hour_cost(spans=whole_hour(2, Decimal(1)), instances=[old, new])
    assert cost.allocated == {"acme": Decimal(2)}
    assert cost.unallocated == 0


def test_an_instance_pays_for_the_part_of_the_hour_it_held_its_gpus() -> None:
    """Stopped ten minutes in, one GPU: a sixth of a GPU-hour is its; the rest of that GPU's
    hour is idle, unless a replacement held it."""
    gone = InstanceHour("gone", 1, 1.0, 1.0, {"acme": (1, 0)}, held_s=600)
    stayed = InstanceHour("stayed", 1, 1.0, 1.0, {"globex": (1, 0)})
    cost = pool_hour_cost(spans=whole_hour(2, Decimal(6)), instances=[gone, stayed])
    assert cost.allocated == {"acme": Decimal(1), "globex": Decimal(6)}
    assert cost.idle == Decimal(5) and cost.warm_idle == 0
    late = InstanceHour("late", 1, 1.0, 1.0, {}, held_s=3000)  # started at minute ten
    cost = pool_hour_cost(spans=whole_hour(2, Decimal(6)), instances=[gone, stayed, late])
    assert cost.idle == 0 and cost.warm_idle == Decimal(5)


def test_reprefill_is_the_operators_line_not_a_tenants() -> None:
    """A continued stream's prompt and relayed text processed again (here 20,000 tokens, 2 s
    at 10,000/s) takes its share of the instance like any work, but no tenant carries it."""
    served = {"acme": (10_000, 1_000), "globex": (0, 1_000)}  # 2 s and 1 s of engine time
    plain = InstanceHour("us-1", 1, 10_000, 1_000, served)
    continued = InstanceHour("us-1", 1, 10_000, 1_000, served, reprefill_tokens=20_000)
    before = pool_hour_cost(spans=whole_hour(1, Decimal(5)), instances=[plain])
    after = pool_hour_cost(spans=whole_hour(1, Decimal(5)), instances=[continued])
    assert before.allocated == {
        "acme": Decimal("3.333333333333"),
        "globex": Decimal("1.666666666667"),
    }
    assert before.reprefill == 0
    # 5 s of engine time: acme 2, globex 1, the operator's re-prefill 2.
    assert after.allocated == {"acme": Decimal(2), "globex": Decimal(1)}
    assert after.reprefill == Decimal(2) and after.unallocated == Decimal(2)
    assert after.busy_s == pytest.approx(5.0)
    assert sum(after.allocated.values()) + after.unallocated == after.cost == Decimal(5)
    # An instance whose only work was re-prefill is busy, not warm idle: all of it is the
    # operator's.
    only = InstanceHour("us-2", 1, 10_000, 1_000, {"acme": (0, 0)}, reprefill_tokens=500)
    alone = pool_hour_cost(spans=whole_hour(1, Decimal(5)), instances=[only])
    assert alone.allocated == {} and alone.warm_idle == 0 and alone.reprefill == Decimal(5)


def test_a_reprefill_ran_on_the_legs_that_continued_the_stream() -> None:
    assert reprefill_by_instance("us-1", "us-east/us-0,us-east/us-1", 1151) == {"us-1": 1151}
    # A remote region continued it: the record names the local instance, the leg the remote.
    assert reprefill_by_instance("us-0", "us-east/us-0,eu-west/eu-3", 90) == {"eu-3": 90}
    # Twice: split evenly (no count per leg), the units left over on the last legs.
    assert reprefill_by_instance("c", "r/a,r/b,r/c", 301) == {"b": 150, "c": 151}
    assert reprefill_by_instance("c", "r/a,r/b,r/c,r/b", 10) == {"b": 7, "c": 3}
    # Legs that name no instance after the first: the record's.
    assert reprefill_by_instance("us-1", "", 40) == {"us-1": 40}
    assert reprefill_by_instance("us-1", "us-east/us-1", 40) == {"us-1": 40}
    assert reprefill_by_instance("us-1", "us-east/us-0,us-east/us-1", 0) == {}


usage = st.dictionaries(
    st.sampled_from(["acme", "globex", "initech", "umbrella"]),
    st.tuples(st.integers(0, 10**7), st.integers(0, 10**6)),
    max_size=4,
)


@given(
    gpus_free=st.integers(0, 64),
    price=st.decimals(Decimal("0"), Decimal("40"), places=6),
    instances=st.lists(
        st.tuples(
            st.integers(1, 8),
            st.floats(100, 50_000),
            st.floats(10, 5_000),
            usage,
            st.floats(0, 3600),
            st.integers(0, 10**7),
        ),
        max_size=6,
    ),
)
def test_allocated_plus_unallocated_is_the_pools_cost_exactly(
    gpus_free: int,
    price: Decimal,
    instances: list[tuple[int, float, float, dict[str, tuple[int, int]], float, int]],
) -> None:
    rows = [
        InstanceHour(f"i{n}", g, p, d, u, held_s=h, reprefill_tokens=r)
        for n, (g, p, d, u, h, r) in enumerate(instances)
    ]
    gpus = gpus_free + sum(r.gpus for r in rows)
    cost = pool_hour_cost(spans=whole_hour(gpus, price), instances=rows)
    assert cost.cost == gpus * price
    assert sum(cost.allocated.values(), start=Decimal(0)) + cost.unallocated == cost.cost
    assert cost.unallocated == cost.idle + cost.warm_idle + cost.reprefill
    assert all(v >= 0 for v in cost.allocated.values()) and cost.reprefill >= 0
    # Re-prefill only ever takes from the tenants' share: never more than without it.
    without = pool_hour_cost(
        spans=whole_hour(gpus, price),
        instances=[dataclasses.replace(r, reprefill_tokens=0) for r in rows],
    )
    total = sum(cost.allocated.values(), start=Decimal(0))
    # What the re-prefill takes is what the tenants (or, for an instance whose only work it
    # was, its warm idle time) carry without it.
    assert cost.idle == without.idle
    assert total + cost.reprefill + cost.warm_idle == (
        sum(without.allocated.values(), start=Decimal(0)) + without.warm_idle
    )
    # (a group's share by at most the last digit's rounding)
    assert all(v <= without.allocated[k] + QUANTUM for k, v in cost.allocated.items())
