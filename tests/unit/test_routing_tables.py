"""The compiled tables: tenants, residency refusals, the demand split turned into weights,
evacuated regions, cost ordering and byte-identical output for an unchanged fleet."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest

from federation.routing.compiler import (
    TARGET_UTILISATION,
    compile_fleet_tables,
    compile_region_table,
    cost_per_mtok,
    fleet_plan,
    replica_tokens_per_s,
)
from federation.routing.snapshot import FleetSnapshot, InstanceRow, KeyRow, RegionRow, TenantRow
from federation.routing.tenant_plan import budget_state
from federation.tenancy.residency import ResidencyPolicy
from regions.tables.schema import decode_table

M8 = "llama-8b"
M70 = "llama-70b"


def _inst(
    name: str,
    region: str,
    *,
    model: str = M8,
    price: float = 2.0,
    speed: float = 1.0,
    tp: int = 1,
    params: float = 8.0,
    state: str = "ready",
    adapters: tuple[str, ...] = (),
    load: float | None = None,
) -> InstanceRow:
    return InstanceRow(
        name=name,
        endpoint_url=f"http://{name}.local:8000",
        state=state,
        region=region,
        model=model,
        role="mixed",
        accelerator="H100-80G",
        relative_speed=speed,
        tensor_parallel_size=tp,
        parameter_count_b=params,
        max_num_seqs=64,
        adapters=adapters,
        price_per_gpu_hour=price,
        load_tokens_per_s=load,
    )


REGIONS = (
    RegionRow("us-east", "active", "US", "http://us.edge"),
    RegionRow("eu-west", "active", "EU", "http://eu.edge"),
    RegionRow("eu-north", "active", "EU", "http://eun.edge"),
    RegionRow("ap-south", "evacuated", "APAC", "http://ap.edge"),
)
RTT = {
    ("us-east", "eu-west"): 75.0,
    ("us-east", "eu-north"): 95.0,
    ("eu-west", "eu-north"): 30.0,
    ("us-east", "ap-south"): 220.0,
    ("eu-west", "ap-south"): 160.0,
    ("eu-north", "ap-south"): 180.0,
}
EXPIRY = datetime(2027, 1, 1, 12, 30, 15, 999, tzinfo=UTC)
TENANTS = (
    TenantRow(
        "globex-eu",
        ResidencyPolicy.of(["EU"]),
        requests_per_minute=300,
        tokens_per_minute=120_000,
        monthly_budget_usd=2000.0,
        keys=(KeyRow("b" * 64, EXPIRY), KeyRow("c" * 64, None, ("usage:read",))),
    ),
    TenantRow(
        "initech",
        ResidencyPolicy(),
        monthly_budget_usd=100.0,
        spend_usd=100.0,
        keys=(KeyRow("a" * 64),),
    ),
    TenantRow("umbrella-ap", ResidencyPolicy.of(["APAC"]), keys=(KeyRow("d" * 64),)),
)
INSTANCES = (
    _inst("us-1", "us-east", price=2.49, adapters=("sql",)),
    _inst("us-2", "us-east", price=2.49, speed=0.5),
    _inst("us-70", "us-east", model=M70, price=2.49, tp=4, params=70.0),
    _inst("eu-1", "eu-west", price=1.2),
    _inst("eun-1", "eu-north", price=0.9),
    _inst("ap-1", "ap-south", price=0.1),  # evacuated: never used, however cheap
    _inst("us-3", "us-east", state="draining"),
)
SNAPSHOT = FleetSnapshot(regions=REGIONS, instances=INSTANCES, rtt_ms=RTT, tenants=TENANTS)
VERSIONS = {r.code: 1 for r in REGIONS}


def _tables(snapshot: FleetSnapshot = SNAPSHOT) -> dict[str, dict]:
    return compile_fleet_tables(snapshot, versions=VERSIONS, generated_at="2026-11-29T10:00:00Z")


def _route(doc: dict, model: str) -> dict:
    return next(r for r in doc["routes"] if r["model"] == model)


def test_every_document_decodes_at_the_edge() -> None:
    for code, doc in _tables().items():
        table = decode_table(orjson.dumps(doc))
        assert table.region == code and table.tenants is not None
        assert {r.model for r in table.routes} == {M8, M70, "sql"}


def test_tenants_carry_keys_expiry_rates_budget_and_allowed_regions() -> None:
    tenants = {t["tenant"]: t for t in _tables()["us-east"]["tenants"]}
    globex = tenants["globex-eu"]
    assert globex["key_hashes"] == ["b" * 64]  # the usage:read key is not an inference key
    assert globex["key_valid_until"] == {"b" * 64: "2027-01-01T12:30:15Z"}
    assert globex["allowed_regions"] == ["eu-north", "eu-west"]
    assert globex["requests_per_s"] == 5.0 and globex["tokens_per_s"] == 2000.0
    assert globex["budget_state"] == "ok"
    initech = tenants["initech"]
    assert initech["allowed_regions"] == ["ap-south", "eu-north", "eu-west", "us-east"]
    assert initech["requests_per_s"] is None and initech["budget_state"] == "exhausted"


def test_budget_states() -> None:
    assert budget_state(monthly_budget_usd=None, spend_usd=1e9) == "ok"
    assert budget_state(monthly_budget_usd=100.0, spend_usd=79.0) == "ok"
    assert budget_state(monthly_budget_usd=100.0, spend_usd=80.0) == "warn"
    assert budget_state(monthly_budget_usd=100.0, spend_usd=100.0) == "exhausted"


def test_a_tenant_allowed_no_serving_region_gets_explicit_refusals() -> None:
    doc = _tables()["eu-west"]
    tenants = {t["tenant"]: t for t in doc["tenants"]}
    classes = {c["id"]: c for c in doc["residency_classes"]}
    umbrella = classes[tenants["umbrella-ap"]["residency_class"]]
    assert umbrella["allowed_regions"] == ["ap-south"]
    # ap-south is evacuated: nothing is served there, so every model is refused with why.
    assert set(umbrella["refusals"]) == {M8, M70, "sql"}
    assert umbrella["refusals"][M8] == "residency"
    globex = classes[tenants["globex-eu"]["residency_class"]]
    # EU serves the 8B model; the 70B and the adapter run only in the US.
    assert set(globex["refusals"]) == {M70, "sql"}
    assert globex["refusals"][M70] == "residency"
    assert classes[tenants["initech"]["residency_class"]]["refusals"] == {}


def test_an_allowed_region_that_cannot_be_reached_from_here_is_an_unreachable_refusal() -> None:
    nordic = TenantRow("nordic", ResidencyPolicy.of(["EU"], ["eu-north"]), keys=(KeyRow("e" * 64),))
    rtt = {k: v for k, v in RTT.items() if k != ("us-east", "eu-north")}
    tables = _tables(FleetSnapshot(REGIONS, INSTANCES, rtt, (*TENANTS, nordic)))

    def refusals(doc: dict) -> dict[str, str]:
        cls = next(t for t in doc["tenants"] if t["tenant"] == "nordic")["residency_class"]
        return next(c for c in doc["residency_classes"] if c["id"] == cls)["refusals"]

    assert refusals(tables["us-east"]) == {M8: "unreachable", M70: "residency", "sql": "residency"}
    assert refusals(tables["eu-west"]) == {M70: "residency", "sql": "residency"}


def test_evacuated_region_has_no_instances_and_is_never_a_remote_target() -> None:
    tables = _tables()
    assert tables["ap-south"]["instances"] == []
    assert [r["code"] for r in tables["ap-south"]["remote_regions"]] == [
        "eu-north",
        "eu-west",
        "us-east",
    ]
    for doc in tables.values():
        assert "ap-south" not in {r["code"] for r in doc["remote_regions"]}
        for route in doc["routes"]:
            assert "ap-south" not in {t["code"] for t in route["remotes"]}
    # The evacuated region's traffic goes elsewhere: its routes have no local share.
    assert _route(tables["ap-south"], M8)["local_weight"] == 0.0


def test_instances_carry_capacity_weights_that_sum_to_one_per_model() -> None:
    instances = {i["id"]: i for i in _tables()["us-east"]["instances"]}
    assert set(instances) == {"us-1", "us-2", "us-70"}  # draining us-3 excluded
    assert instances["us-1"]["weight"] + instances["us-2"]["weight"] == pytest.approx(1.0)
    assert instances["us-1"]["weight"] == pytest.approx(2 * instances["us-2"]["weight"], 1e-3)
    assert instances["us-70"]["weight"] == 1.0
    full = replica_tokens_per_s(relative_speed=1.0, tensor_parallel_size=1, params_b=8.0)
    assert instances["us-1"]["capacity_tokens_per_s"] == pytest.approx(
        full * TARGET_UTILISATION, abs=0.1
    )


def test_remote_costs_come_from_price_tp_and_throughput_and_order_the_spill_over() -> None:
    doc = _tables()["us-east"]
    remotes = _route(doc, M8)["remotes"]
    # eu-north is cheaper (0.9 vs 1.2 per GPU-hour) and worth its extra 20 ms.
    assert [r["code"] for r in remotes] == ["eu-north", "eu-west"]
    tokens = replica_tokens_per_s(relative_speed=1.0, tensor_parallel_size=1, params_b=8.0)
    assert remotes[0]["cost_per_mtok"] == pytest.approx(
        cost_per_mtok(price_per_gpu_hour=0.9, gpus=1, tokens_per_s=tokens), abs=1e-4
    )
    assert remotes[0]["rtt_ms"] == 95.0
    # The 70B model on TP4 costs four GPUs per replica.
    route70 = _route(doc, M70)
    tokens70 = replica_tokens_per_s(relative_speed=1.0, tensor_parallel_size=4, params_b=70.0)
    assert route70["local_cost_per_mtok"] == pytest.approx(
        cost_per_mtok(price_per_gpu_hour=2.49, gpus=4, tokens_per_s=tokens70), abs=1e-4
    )
    assert route70["remotes"] == []


def test_demand_split_becomes_weights_that_sum_to_one_with_the_unserved_share() -> None:
    cap_eu = replica_tokens_per_s(relative_speed=1.0, tensor_parallel_size=1, params_b=8.0) * 0.65
    snapshot = FleetSnapshot(
        regions=REGIONS,
        instances=INSTANCES,
        rtt_ms=RTT,
        tenants=TENANTS,
        # Far more than the whole fleet can take: the excess must be reported, not dropped.
        demand_tokens_per_s={("us-east", M8): 10 * cap_eu, ("eu-west", M8): 0.5 * cap_eu},
    )
    tables = _tables(snapshot)
    for code in ("us-east", "eu-west"):
        route = _route(tables[code], M8)
        assert route["demand_tokens_per_s"] > 0
        share = route["local_weight"] + sum(r["weight"] for r in route["remotes"])
        unserved = route["unserved_tokens_per_s"] / route["demand_tokens_per_s"]
        assert share + unserved == pytest.approx(1.0, abs=1e-3)
    us = _route(tables["us-east"], M8)
    assert us["unserved_tokens_per_s"] > 0
    # Capacity is full everywhere the split could use it: no headroom left to advertise.
    assert all(r["headroom_tokens_per_s"] == pytest.approx(0.0, abs=0.5) for r in us["remotes"])


def test_without_demand_the_weight_goes_to_the_cheapest_target_after_latency() -> None:
    tables = _tables()
    assert _route(tables["eu-west"], M8)["local_weight"] == 0.0  # eu-north: 0.9 vs 1.2, 30 ms
    assert {r["code"]: r["weight"] for r in _route(tables["eu-west"], M8)["remotes"]}[
        "eu-north"
    ] == 1.0
    assert _route(tables["us-east"], M70)["local_weight"] == 1.0


def test_demand_defaults_to_the_load_the_instances_report() -> None:
    loaded = tuple(
        _inst("us-1", "us-east", price=2.49, load=1500.0) if i.name == "us-1" else i
        for i in INSTANCES
    )
    plan = fleet_plan(FleetSnapshot(REGIONS, loaded, RTT, TENANTS))
    assert plan.demand == {("us-east", M8): 1500.0}
    # Demand seen in us-east belongs to the tenants that may be served there (initech, who
    # may go anywhere): all served, in eu-north, whose GPUs cost a third of us-east's even
    # after 95 ms of latency penalty.
    assert sum(plan.split.load.values()) == pytest.approx(1500.0)
    assert plan.split.origin_fractions[("us-east", M8)] == pytest.approx({"eu-north": 1.0})


def test_demand_at_an_origin_no_tenant_may_use_is_shared_by_all_classes() -> None:
    plan = fleet_plan(
        FleetSnapshot(REGIONS, INSTANCES, RTT, TENANTS, demand_tokens_per_s={("ap-south", M8): 900})
    )
    # Classes containing ap-south: initech (any) and umbrella (APAC): half each. Umbrella's
    # only region is evacuated, so its half is reported unserved; initech's half is served.
    assert plan.split.origin_unserved[("ap-south", M8)] == pytest.approx(450.0)
    assert sum(plan.split.origin_fractions[("ap-south", M8)].values()) == pytest.approx(0.5)


def test_unchanged_fleet_compiles_to_identical_bytes() -> None:
    first = {c: orjson.dumps(d) for c, d in _tables().items()}
    shuffled = FleetSnapshot(
        regions=tuple(reversed(REGIONS)),
        instances=tuple(reversed(INSTANCES)),
        rtt_ms=dict(reversed(list(RTT.items()))),
        tenants=tuple(reversed(TENANTS)),
    )
    assert {c: orjson.dumps(d) for c, d in _tables(shuffled).items()} == first
    single = compile_region_table(
        SNAPSHOT, region="eu-west", version=1, generated_at="2026-11-29T10:00:00Z"
    )
    assert orjson.dumps(single) == first["eu-west"]


def test_a_negative_demand_forecast_is_refused() -> None:
    snapshot = FleetSnapshot(
        REGIONS, INSTANCES, RTT, TENANTS, demand_tokens_per_s={("us-east", M8): -5.0}
    )
    with pytest.raises(ValueError, match="negative demand"):
        fleet_plan(snapshot)


def test_compiling_region_by_region_plans_the_snapshot_once() -> None:
    snapshot = FleetSnapshot(REGIONS, INSTANCES, RTT, TENANTS)
    docs = {
        r.code: compile_region_table(
            snapshot, region=r.code, version=1, generated_at="2026-11-29T10:00:00Z"
        )
        for r in REGIONS
    }
    assert len(snapshot.plans) == 1  # one demand split for all four regions
    assert docs == _tables(FleetSnapshot(REGIONS, INSTANCES, RTT, TENANTS))


def test_a_region_with_several_live_edges_shares_rate_limits_among_them() -> None:
    regions = tuple(
        RegionRow(r.code, r.status, r.jurisdiction, r.edge_url,
                  edges=("eu-a", "eu-b", "eu-c") if r.code == "eu-west" else ("us-a",))
        for r in REGIONS
    )  # fmt: skip
    tables = _tables(FleetSnapshot(regions=regions, instances=INSTANCES, rtt_ms=RTT,
                                   tenants=TENANTS))  # fmt: skip
    eu = decode_table(orjson.dumps(tables["eu-west"]))
    assert eu.local_edges == 3 and eu.schema_version == 5
    # One edge: no field, and the schema the table needed before.
    assert "local_edges" not in tables["us-east"]
    assert decode_table(orjson.dumps(tables["us-east"])).local_edges == 1
    assert tables["us-east"]["schema_version"] < 5
