"""The pool-hour cost split: every pool's hour is accounted for to 1e-12 USD — allocated to
the usage it served by engine time, or unallocated as idle GPUs or warm idle instances."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from federation.metering.cost import InstanceHour, pool_hour_cost, split_exactly, whole_hour


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
        ),
        max_size=6,
    ),
)
def test_allocated_plus_unallocated_is_the_pools_cost_exactly(
    gpus_free: int,
    price: Decimal,
    instances: list[tuple[int, float, float, dict[str, tuple[int, int]], float]],
) -> None:
    rows = [
        InstanceHour(f"i{n}", g, p, d, u, held_s=h) for n, (g, p, d, u, h) in enumerate(instances)
    ]
    gpus = gpus_free + sum(r.gpus for r in rows)
    cost = pool_hour_cost(spans=whole_hour(gpus, price), instances=rows)
    assert cost.cost == gpus * price
    assert sum(cost.allocated.values(), start=Decimal(0)) + cost.unallocated == cost.cost
    assert all(v >= 0 for v in cost.allocated.values())
