"""The console's pure pieces: previews of actions (compiled by the routing compiler, decided by
the edge's rules), the request explanation, the overview's figures, table diffs, chart series."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

import msgspec
import pytest

from console.charts import MAX_SERIES, chart_series
from console.explain import decide
from console.fleet import InstanceLoad, Traffic, alerts, percentile, region_cards
from console.preview import preview, snapshot_after
from console.tablediff import table_diff
from federation.routing.compiler import fleet_plan, region_table
from federation.routing.snapshot import (
    FleetSnapshot,
    InstanceRow,
    KeyRow,
    RampPolicy,
    RegionRow,
    TenantRow,
)
from federation.tenancy.residency import ResidencyPolicy
from regions.tables.schema import ColdModel

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)


def _instance(name: str, region: str, *, state: str = "ready", model: str = "m-8b") -> InstanceRow:
    return InstanceRow(
        name=name,
        endpoint_url=f"http://{name}.invalid:8000",
        state=state,
        region=region,
        model=model,
        role="mixed",
        accelerator="H100-80G",
        relative_speed=1.0,
        tensor_parallel_size=1,
        parameter_count_b=8.0,
        max_num_seqs=128,
        price_per_gpu_hour=2.5 if region == "us-east" else 1.5,
    )


def _tenant(slug: str, jurisdictions: tuple[str, ...] = ()) -> TenantRow:
    return TenantRow(
        slug=slug,
        policy=ResidencyPolicy.of(list(jurisdictions), ()),
        keys=(KeyRow(f"{slug:0<64}"[:64]),),
    )


SNAPSHOT = FleetSnapshot(
    regions=(
        RegionRow("us-east", "active", "US", edge_url="http://edge-us-east.invalid"),
        RegionRow("us-west", "active", "US", edge_url="http://edge-us-west.invalid"),
        RegionRow("eu-west", "active", "EU", edge_url="http://edge-eu-west.invalid"),
    ),
    instances=(
        _instance("use-1", "us-east"),
        _instance("usw-1", "us-west"),
        _instance("euw-1", "eu-west"),
    ),
    rtt_ms={
        ("us-east", "us-west"): 60.0,
        ("us-east", "eu-west"): 75.0,
        ("us-west", "eu-west"): 140.0,
    },
    tenants=(_tenant("acme", ("US",)), _tenant("globex", ("EU",)), _tenant("initech")),
    now=NOW,
)


def _moves(result: object) -> dict[tuple[str, str], tuple[str | None, str | None]]:
    return {
        (tenant, m.origin): (m.before.region, m.after.region)
        for m in result.moves  # type: ignore[attr-defined]
        for tenant in m.group.tenants
    }


def test_evacuating_a_region_moves_tenants_and_refuses_those_with_nowhere_else() -> None:
    after = snapshot_after(
        SNAPSHOT,
        region_status={"eu-west": "evacuated"},
        instance_states={"euw-1": "draining"},
    )
    result = preview(SNAPSHOT, after)
    moves = _moves(result)
    # globex may only be served in the EU: refused at every edge once eu-west is gone.
    assert moves[("globex", "eu-west")] == ("eu-west", None)
    assert moves[("globex", "us-east")] == ("eu-west", None)
    # initech arriving at eu-west's edge is forwarded to an American region instead.
    before, now = moves[("initech", "eu-west")]
    assert before == "eu-west" and now in {"us-east", "us-west"}
    # acme (US only) never went to eu-west: nothing changes for it.
    assert not any(t == "acme" for t, _ in moves)
    assert result.leaving == ["euw-1"] and result.joining == []
    assert {m.group.tenants for m in result.refusals} == {("globex",)}
    assert result.serving_usd_per_hour[1] < result.serving_usd_per_hour[0]


def test_a_change_that_moves_nothing_previews_as_such() -> None:
    result = preview(SNAPSHOT, snapshot_after(SNAPSHOT))
    assert not result.changes_routing
    assert result.serving_usd_per_hour[0] == result.serving_usd_per_hour[1]


def test_snapshot_after_does_not_share_the_plan_memo() -> None:
    fleet_plan(SNAPSHOT)
    SNAPSHOT.plans[0.0002] = fleet_plan(SNAPSHOT)
    after = snapshot_after(SNAPSHOT, instance_states={"use-1": "draining"})
    assert after.plans == {} and after.instances[0].state == "draining"
    assert SNAPSHOT.instances[0].state == "ready"


def _table(snapshot: FleetSnapshot, region: str):  # type: ignore[no-untyped-def]
    return region_table(snapshot, region=region, version=1, generated_at="x")


def test_decide_local_residency_not_local_and_refusal() -> None:
    table = _table(SNAPSHOT, "us-east")
    policy = {t.tenant: t for t in table.tenants or ()}
    local = decide(table, policy["initech"], "m-8b")
    assert (local.region, local.reason) == ("us-east", "local")
    assert [c.id for c in local.candidates] == ["use-1"]
    moved = decide(table, policy["globex"], "m-8b")
    assert (moved.region, moved.reason) == ("eu-west", "residency")
    unknown = decide(table, policy["initech"], "gpt-9")
    assert (unknown.region, unknown.status, unknown.reason) == (None, 404, "model_not_found")
    drained = snapshot_after(SNAPSHOT, instance_states={"use-1": "draining"})
    elsewhere = decide(_table(drained, "us-east"), policy["acme"], "m-8b")
    assert (elsewhere.region, elsewhere.reason) == ("us-west", "not_local")


def test_decide_holds_a_model_scaled_to_zero_here_as_the_edge_does() -> None:
    """The edge holds a request for a cold model until a replica starts (its spill-over
    stage, ``first_targets``): the console says so instead of a 404."""
    table = msgspec.structs.replace(
        _table(SNAPSHOT, "us-east"), cold_models=(ColdModel(model="m-cold", adapters=("a-1",)),)
    )
    policy = {t.tenant: t for t in table.tenants or ()}
    for name in ("m-cold", "a-1"):
        held = decide(table, policy["acme"], name)
        assert (held.region, held.reason) == ("us-east", "cold")
        assert "scaled to zero" in held.explanation
    # A tenant who may not be served here is refused as the edge refuses it.
    refused = decide(table, policy["globex"], "m-cold")
    assert (refused.region, refused.status, refused.reason) == (None, 403, "region_not_allowed")


def test_decide_refuses_a_tenant_over_budget_as_the_edge_does() -> None:
    broke = TenantRow(
        slug="broke", monthly_budget_usd=10.0, spend_usd=10.0, keys=(KeyRow("b" * 64),)
    )
    snapshot = snapshot_after(SNAPSHOT)
    snapshot = FleetSnapshot(
        regions=snapshot.regions,
        instances=snapshot.instances,
        rtt_ms=snapshot.rtt_ms,
        tenants=(broke,),
    )
    table = _table(snapshot, "us-east")
    decision = decide(table, (table.tenants or ())[0], "m-8b")
    assert decision.region is None and decision.status == 403
    assert decision.reason == "budget_exhausted" and "budget" in decision.explanation


def test_region_cards_read_load_against_the_band_and_traffic() -> None:
    edge = SimpleNamespace(name="e1", applied_table_version=4, last_heartbeat_at=NOW)
    region = SimpleNamespace(
        code="us-east",
        name="US East",
        jurisdiction="US",
        status="active",
        latest_version=5,
        edges=SimpleNamespace(all=lambda: [edge]),
        restored_at=NOW - timedelta(seconds=20),
        recovered_at=None,
    )

    def load(name: str, state: str, tokens: float | None, healthy: bool | None) -> InstanceLoad:
        return InstanceLoad(name, "us-east", "p", "m", state, 1000.0, tokens, 1, healthy)

    loads = [
        load("a", "ready", 400.0, True),
        load("b", "ready", 250.0, False),
        load("c", "draining", 900.0, True),  # not counted in load: gets no new traffic
        load("d", "stopped", None, None),
    ]
    traffic = [Traffic("us-east", "us-east", float(ms), 200) for ms in range(1, 101)]
    traffic += [Traffic("us-east", "eu-west", 5.0, 200), Traffic("us-east", "us-east", None, 503)]
    (card,) = region_cards([region], loads, traffic, now=NOW, ramp=RampPolicy(60.0, 4))
    assert (card.instances, card.ready, card.unhealthy) == (3, 2, 1)
    assert card.utilisation == 650.0 / 2000.0 and card.band == "under"
    assert (card.ttft_p50_ms, card.ttft_p99_ms) == (50.0, 99.0)
    assert card.spill_out == {"eu-west": 1}
    assert card.edges[0].current is False  # applied 4, latest 5
    # Restored 20 s ago, 4 steps over 60 s: on its second step (2/5), the next in 10 s.
    assert card.ramp == 0.4 and card.ramp_next_s == pytest.approx(10.0)
    assert alerts([card], NOW) == [
        "us-east: 1 ready instance(s) reported unhealthy",
        "us-east: edge e1 runs table v4, latest is v5",
    ]
    assert alerts([card], NOW + timedelta(minutes=2))[-1] == (
        "us-east: edge e1 has not sent a heartbeat for a minute"
    )


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0


def test_table_diff_sections() -> None:
    old = {
        "schema_version": 1,
        "ramp": 1.0,
        "instances": [{"id": "a", "weight": 0.5}, {"id": "b", "weight": 0.5}],
        "tenants": [{"tenant": "t1", "budget_state": "ok"}],
    }
    new = {
        "schema_version": 2,
        "ramp": 0.2,
        "instances": [{"id": "a", "weight": 1.0}, {"id": "c", "weight": 0.0}],
        "tenants": [{"tenant": "t1", "budget_state": "ok"}],
    }
    diff = table_diff(old, new)
    instances = diff.sections[0]
    assert (instances.added, instances.removed) == (["c"], ["b"])
    assert instances.changed[0].key == "a" and instances.changed[0].fields == (
        ("weight", 0.5, 1.0),
    )
    assert diff.scalars == [("schema_version", 1, 2), ("ramp", 1.0, 0.2)]
    assert not table_diff(old, old)


def test_chart_series_fill_gaps_and_fold_small_groups() -> None:
    rows = [
        {"day": date(2026, 11, 1), "model": "a", "price_usd": Decimal("1.5")},
        {"day": date(2026, 11, 2), "model": "b", "price_usd": Decimal("2")},
    ]
    chart = chart_series(rows, time_key="day", group_key="model", metric="price_usd")
    first = int(datetime(2026, 11, 1, tzinfo=UTC).timestamp())
    assert chart["x"] == [first, first + 86_400]
    assert chart["series"] == [
        {"label": "b", "values": [0.0, 2.0]},
        {"label": "a", "values": [1.5, 0.0]},
    ]
    many = [
        {"hour": NOW + timedelta(hours=i % 2), "pool": f"p{i}", "cost_usd": i + 1}
        for i in range(MAX_SERIES + 3)
    ]
    folded = chart_series(many, time_key="hour", group_key="pool", metric="cost_usd")
    assert len(folded["series"]) == MAX_SERIES + 1
    assert folded["series"][-1]["label"] == "other (3)"
    total = sum(sum(s["values"]) for s in folded["series"])
    assert total == sum(i + 1 for i in range(MAX_SERIES + 3))


def test_chart_series_with_the_overall_report_draws_the_rest_as_other() -> None:
    day1, day2 = date(2026, 11, 1), date(2026, 11, 2)
    top = [
        {"day": day1, "tenant": "a", "requests": 5},
        {"day": day2, "tenant": "b", "requests": 7},
    ]
    overall = [{"day": day1, "requests": 9}, {"day": day2, "requests": 8}]
    chart = chart_series(
        top, time_key="day", group_key="tenant", metric="requests", overall=overall, hidden=40
    )
    assert chart["series"] == [
        {"label": "b", "values": [0.0, 7.0]},
        {"label": "a", "values": [5.0, 0.0]},
        {"label": "other (40)", "values": [4.0, 1.0]},
    ]
