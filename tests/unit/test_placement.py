"""The placement planner (federation/fleet/placement.py): every plan fits, packs onto nodes,
covers demand at the target within residency, and moves as little as it can."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from federation.fleet.placement import plan_placement
from federation.fleet.placement_milp import node_patterns, smallest_fitting_tp
from federation.fleet.placement_types import (
    NO_FITTING_POOL,
    NO_FREE_GPUS,
    RESIDENCY,
    UNREACHABLE,
    Current,
    Demand,
    PlacementInput,
    Plan,
    PlannedModel,
    PlannerPolicy,
    PoolOffer,
)
from federation.inventory import fit

ANY = frozenset({"us", "eu", "ap"})
CLASSES = {"any": ANY, "eu-only": frozenset({"eu"}), "ap-only": frozenset({"ap"})}


def pool(
    region: str,
    name: str = "h100",
    *,
    memory: float = 80,
    per_node: int = 8,
    nodes: int = 2,
    interconnect: str = "nvlink",
    speed: float = 1.0,
    price: float = 3.0,
    accepts_new: bool = True,
) -> PoolOffer:
    return PoolOffer(
        key=f"{region}/{name}",
        region=region,
        spec=fit.PoolSpec(
            name=name,
            accelerator_name=name,
            accelerator_memory_gib=memory,
            gpus_per_node=per_node,
            node_count=nodes,
            interconnect=interconnect,
            rdma=False,
            gpu_memory_utilization=0.9,
        ),
        relative_speed=speed,
        price_per_gpu_hour=price,
        accepts_new=accepts_new,
    )


def model(name: str, params_b: float) -> PlannedModel:
    big = params_b > 30
    return PlannedModel(
        name=name,
        spec=fit.ModelSpec(
            name=name,
            weight_size_gib=params_b * 1.86,
            max_context_tokens=8192,
            num_layers=80 if big else 32,
            num_attention_heads=64 if big else 32,
            num_kv_heads=8,
            head_dim=128,
        ),
        params_b=params_b,
    )


SMALL, LARGE = model("small-8b", 8), model("large-70b", 70)


def check_plan(data: PlacementInput, plan: Plan, target: float = 0.65) -> None:
    """The invariants every plan keeps, checked from the plan's own output."""
    pools = {p.key: p for p in data.pools}
    models = {m.name: m for m in data.models}
    for p in plan.placements:
        offer = pools[p.pool]
        if p.after and p.before == 0:  # a new replica must start on the pool
            assert not fit.check_parallelism(
                p.tensor_parallel_size, model=models[p.model].spec, pool=offer.spec
            )
            assert not fit.check_memory(
                p.tensor_parallel_size, model=models[p.model].spec, pool=offer.spec, engine_args={}
            )
    for key, uses in plan.nodes.items():
        offer = pools[key]
        assert sum(u.count for u in uses) <= offer.free_nodes
        for use in uses:
            assert sum(tp for _, tp in use.replicas) <= offer.spec.gpus_per_node * max(1, use.count)
    placed: dict[tuple[str, int], int] = defaultdict(int)
    for key, uses in plan.nodes.items():
        for use in uses:
            per_node = pools[key].spec.gpus_per_node
            times = 1 if use.replicas[0][1] > per_node else use.count
            for name, tp in use.replicas:
                placed[(key + name, tp)] += times
    for p in plan.placements:
        assert placed[(p.pool + p.model, p.tensor_parallel_size)] == p.after
    # demand covered within residency: new capacity at the target, what ran before up to the
    # band's top (70 %)
    after: dict[tuple[str, str], float] = defaultdict(float)
    before: dict[tuple[str, str], float] = defaultdict(float)
    for p in plan.placements:
        after[(p.region, p.model)] += p.replica_tokens_per_s * p.after
        before[(p.region, p.model)] += p.replica_tokens_per_s * p.before
    capacity = {
        key: min(0.70 * after[key], target * after[key] + (0.70 - target) * before[key])
        for key in after
    }
    for key, tokens in plan.served.items():
        assert tokens <= capacity.get(key, 0.0) + 1e-6
    unserved = sum(u.tokens_per_s for u in plan.unserved)
    assert (
        abs(sum(plan.served.values()) + unserved - sum(d.tokens_per_s for d in data.demand)) < 1e-3
    )
    for key, tokens in plan.served.items():
        region, name = key
        allowed_here = sum(
            d.tokens_per_s
            for d in data.demand
            if d.model == name and region in data.classes[d.residency_class]
        )
        assert tokens <= allowed_here + 1e-6


def test_covers_demand_at_the_target_on_the_cheapest_fitting_pool() -> None:
    data = PlacementInput(
        pools=[
            pool("us", "h100", price=3.0),
            pool("us", "l40s", memory=48, interconnect="pcie", speed=0.45, price=1.0),
        ],
        models=[SMALL],
        demand=[Demand("any", "us", "small-8b", 20_000)],
        classes=CLASSES,
    )
    plan = plan_placement(data)
    check_plan(data, plan)
    assert not plan.unserved
    # per token the L40S is cheaper (1.0 / 0.45 < 3.0 / 1.0)
    assert {p.pool for p in plan.placements if p.after} == {"us/l40s"}
    cap = plan.placements[0].replica_tokens_per_s
    assert plan.placements[0].after == -(-20_000 // (0.65 * cap))


def test_large_model_gets_a_tp_group_within_one_node() -> None:
    offer = pool("us")
    assert smallest_fitting_tp(LARGE, offer) == 2
    assert smallest_fitting_tp(LARGE, pool("us", "l4", memory=24, interconnect="pcie")) is None
    data = PlacementInput(
        pools=[offer],
        models=[LARGE, SMALL],
        demand=[Demand("any", "us", "large-70b", 3000), Demand("any", "us", "small-8b", 3000)],
        classes=CLASSES,
    )
    plan = plan_placement(data)
    check_plan(data, plan)
    assert {(p.model, p.tensor_parallel_size) for p in plan.placements} == {
        ("large-70b", 2),
        ("small-8b", 1),
    }


def test_bin_packing_respects_nodes_not_just_gpu_count() -> None:
    # 6 GPUs per node, TP 4 replicas: one per node however many GPUs are left over
    offer = pool("us", per_node=6, nodes=3)
    big = dataclasses.replace(LARGE, spec=dataclasses.replace(LARGE.spec, weight_size_gib=200))
    assert smallest_fitting_tp(big, offer) == 4
    data = PlacementInput(
        pools=[offer], models=[big], demand=[Demand("any", "us", "large-70b", 1e6)], classes=CLASSES
    )
    plan = plan_placement(data)
    check_plan(data, plan)
    assert plan.placements[0].after == 3  # 18 GPUs would hold 4 groups of 4 by count alone
    assert plan.unserved and plan.unserved[0].reason == NO_FREE_GPUS


def test_residency_keeps_eu_demand_in_the_eu_and_reports_the_rest() -> None:
    data = PlacementInput(
        pools=[pool("us", price=1.0), pool("eu", price=5.0)],
        models=[SMALL, LARGE],
        demand=[
            Demand("eu-only", "eu", "small-8b", 5000),
            Demand("ap-only", "ap", "small-8b", 100),
            Demand("any", "us", "unknown-model", 100),
        ],
        classes=CLASSES,
    )
    plan = plan_placement(data)
    check_plan(data, plan)
    assert [p.pool for p in plan.placements if p.after] == ["eu/h100"]  # not the cheap US pool
    reasons = {(u.model, u.residency_class): u.reason for u in plan.unserved}
    assert reasons == {
        ("small-8b", "ap-only"): RESIDENCY,
        ("unknown-model", "any"): NO_FITTING_POOL,
    }


def test_node_patterns_are_maximal() -> None:
    assert sorted(node_patterns([4], 6)) == [(1,)]
    assert sorted(node_patterns([1, 4], 6)) == [(2, 1), (6, 0)]


# --- churn -------------------------------------------------------------------------------------


def _churn_fleet(factor: float) -> PlacementInput:
    # Runs today on the dearer pool of each region; the cheaper one is 10 % cheaper.
    regions = ("us", "eu", "ap")
    pools = [pool(r, "a", price=3.3, nodes=4) for r in regions] + [
        pool(r, "b", price=3.0, nodes=4) for r in regions
    ]
    demand = [
        Demand("any", r, m.name, factor * t)
        for r in regions
        for m, t in ((SMALL, 9000), (LARGE, 2500))
    ]
    plan = plan_placement(
        PlacementInput(
            pools=[p for p in pools if p.key.endswith("/a")],
            models=[SMALL, LARGE],
            demand=demand,
            classes=CLASSES,
        )
    )
    current = [
        Current(p.model, p.pool, p.tensor_parallel_size, p.after)
        for p in plan.placements
        if p.after
    ]
    base = [Demand("any", r, m.name, t) for r in regions for m, t in ((SMALL, 9000), (LARGE, 2500))]
    return PlacementInput(
        pools=pools, models=[SMALL, LARGE], demand=base, classes=CLASSES, current=current
    )


def test_five_percent_more_demand_changes_nothing() -> None:
    fleet = _churn_fleet(1.0)  # today's fleet was planned for today's demand
    for factor in (0.95, 1.0, 1.05):
        data = dataclasses.replace(
            fleet,
            demand=[
                dataclasses.replace(d, tokens_per_s=d.tokens_per_s * factor) for d in fleet.demand
            ],
        )
        plan = plan_placement(data)
        check_plan(data, plan)
        assert plan.changes == 0, (factor, [p for p in plan.placements if p.action != "keep"])


def test_a_bigger_change_moves_the_minimum() -> None:
    fleet = _churn_fleet(1.0)
    data = dataclasses.replace(
        fleet,
        demand=[dataclasses.replace(d, tokens_per_s=d.tokens_per_s * 1.5) for d in fleet.demand],
    )
    plan = plan_placement(data)
    check_plan(data, plan)
    assert not plan.unserved
    assert all(p.after >= p.before for p in plan.placements)  # nothing removed or moved
    without_churn = plan_placement(data, PlannerPolicy(churn_weight=0.0))
    fresh = plan_placement(dataclasses.replace(data, current=()))
    added = sum(p.after - p.before for p in plan.placements)
    # the fewest GPUs that cover the new demand on top of what runs now
    assert added <= without_churn.changes
    assert plan.changes < sum(p.after for p in fresh.placements) + sum(
        c.replicas for c in fleet.current
    )


def test_without_churn_penalty_the_cheaper_pools_win() -> None:
    """The churn test above is not vacuous: the cheaper pools are worth moving to when
    moving is free."""
    fleet = _churn_fleet(1.0)
    plan = plan_placement(fleet, PlannerPolicy(churn_weight=0.0))
    assert plan.changes > 0
    assert plan.usd_per_hour_after < plan.usd_per_hour_before


# --- properties --------------------------------------------------------------------------------

pool_st = st.builds(
    pool,
    region=st.sampled_from(["us", "eu", "ap"]),
    name=st.sampled_from(["h100", "l40s", "a10"]),
    memory=st.sampled_from([24.0, 48.0, 80.0]),
    per_node=st.sampled_from([1, 2, 4, 6, 8]),
    nodes=st.integers(0, 3),
    interconnect=st.sampled_from(["nvlink", "pcie"]),
    price=st.floats(0.5, 5.0),
    accepts_new=st.booleans(),
)
demand_st = st.builds(
    Demand,
    residency_class=st.sampled_from(sorted(CLASSES)),
    origin=st.sampled_from(["us", "eu", "ap"]),
    model=st.sampled_from(["small-8b", "large-70b"]),
    tokens_per_s=st.floats(0, 20_000),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pools=st.lists(pool_st, max_size=5, unique_by=lambda p: p.key),
    demand=st.lists(demand_st, max_size=8),
)
def test_every_plan_fits_packs_and_respects_residency(
    pools: list[PoolOffer], demand: list[Demand]
) -> None:
    data = PlacementInput(pools=pools, models=[SMALL, LARGE], demand=demand, classes=CLASSES)
    plan = plan_placement(data)
    check_plan(data, plan)
    for u in plan.unserved:
        assert u.reason in {RESIDENCY, NO_FITTING_POOL, NO_FREE_GPUS, UNREACHABLE}


def test_demand_goes_only_where_a_region_link_reaches() -> None:
    pools = [pool("us", price=1.0), pool("eu", price=3.0)]
    demand = [Demand("any", "ap", "small-8b", 1000)]
    linked = PlacementInput(
        pools=pools, models=[SMALL], demand=demand, classes=CLASSES, rtt_ms={("ap", "eu"): 150.0}
    )
    plan = plan_placement(linked)
    check_plan(linked, plan)
    assert [p.pool for p in plan.placements] == ["eu/h100"]  # the cheap US is out of reach
    alone = dataclasses.replace(linked, rtt_ms={})
    assert [(u.reason, u.tokens_per_s) for u in plan_placement(alone).unserved] == [
        (UNREACHABLE, 1000)
    ]


def test_static_capacity_counts_before_any_replica_is_added() -> None:
    data = PlacementInput(
        pools=[pool("us")],
        models=[SMALL],
        demand=[Demand("any", "us", "small-8b", 5000)],
        classes=CLASSES,
        fixed_capacity={("us", "small-8b"): 6000.0},
    )
    assert plan_placement(data).placements == ()
    more = dataclasses.replace(data, demand=[Demand("any", "us", "small-8b", 9000)])
    assert [p.after for p in plan_placement(more).placements] == [1]


def test_a_tp_group_spans_nodes_only_over_rdma() -> None:
    huge = dataclasses.replace(LARGE, spec=dataclasses.replace(LARGE.spec, weight_size_gib=300))
    plain = pool("us", per_node=4, nodes=4)
    assert smallest_fitting_tp(huge, plain) is None
    linked = dataclasses.replace(plain, spec=dataclasses.replace(plain.spec, rdma=True))
    assert smallest_fitting_tp(huge, linked) == 8
    data = PlacementInput(
        pools=[linked],
        models=[huge],
        demand=[Demand("any", "us", "large-70b", 1e6)],
        classes=CLASSES,
    )
    plan = plan_placement(data)
    check_plan(data, plan)
    assert plan.placements[0].after == 2  # two groups of two whole nodes each
    assert [u.count for u in plan.nodes["us/h100"]] == [2, 2]
