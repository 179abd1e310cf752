"""A returning region's traffic ramps back in steps (the compiler's part). Pure."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import orjson
import pytest

from federation.routing.compiler import compile_fleet_tables, fleet_plan
from federation.routing.ramp import ramp_level, ramp_next_change_s, region_down
from federation.routing.snapshot import FleetSnapshot, InstanceRow, RampPolicy, RegionRow
from regions.tables.schema import decode_table

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
POLICY = RampPolicy(window_s=60.0, steps=4)


def _instance(name: str, region: str, healthy: bool | None = None) -> InstanceRow:
    return InstanceRow(
        name=name,
        endpoint_url=f"http://127.0.0.1:{9000 + len(name)}",
        state="ready",
        region=region,
        model="m-8b",
        role="mixed",
        accelerator="H100-80G",
        relative_speed=1.0,
        tensor_parallel_size=1,
        parameter_count_b=8.0,
        max_num_seqs=64,
        price_per_gpu_hour=2.0,
        healthy=healthy,
    )


def snapshot(
    *,
    restored_ago: float | None = None,
    recovered_ago: float | None = None,
    eu_health: tuple[bool | None, ...] = (None, None),
    status: str = "active",
) -> FleetSnapshot:
    def ago(seconds: float | None) -> datetime | None:
        return None if seconds is None else NOW - timedelta(seconds=seconds)

    return FleetSnapshot(
        regions=(
            RegionRow(
                "eu-west",
                status,
                "EU",
                edge_url="http://eu",
                restored_at=ago(restored_ago),
                recovered_at=ago(recovered_ago),
            ),
            RegionRow("us-east", "active", "US", edge_url="http://us"),
        ),
        instances=(
            *(_instance(f"eu-{i}", "eu-west", h) for i, h in enumerate(eu_health)),
            _instance("us-0", "us-east"),
        ),
        rtt_ms={("eu-west", "us-east"): 75.0},
        now=NOW,
        ramp=POLICY,
    )


def tables(snap: FleetSnapshot) -> dict[str, dict]:
    return compile_fleet_tables(snap, versions={"eu-west": 3, "us-east": 5}, generated_at="x")


@pytest.mark.parametrize(
    ("elapsed", "level"),
    [(-5.0, 0.2), (0.0, 0.2), (14.9, 0.2), (15.0, 0.4), (30.0, 0.6), (59.9, 0.8), (60.0, 1.0)],
)
def test_level_rises_in_steps_over_the_window(elapsed: float, level: float) -> None:
    assert ramp_level(elapsed, POLICY) == pytest.approx(level)


def test_next_change_is_the_next_step_boundary_and_none_once_done() -> None:
    assert ramp_next_change_s(0.0, POLICY) == pytest.approx(15.0)
    assert ramp_next_change_s(20.0, POLICY) == pytest.approx(10.0)
    assert ramp_next_change_s(59.0, POLICY) == pytest.approx(1.0)
    assert ramp_next_change_s(60.0, POLICY) is None
    assert ramp_level(0.0, RampPolicy(steps=0)) == 1.0  # no steps: no ramp


def test_a_region_is_down_only_when_every_routable_instance_is_reported_unhealthy() -> None:
    assert region_down([False, False])
    assert not region_down([False, None])  # one nobody reports on: not known to be down
    assert not region_down([False, True])
    assert not region_down([])


def test_without_a_restore_or_recovery_tables_stay_schema_1_without_ramp_fields() -> None:
    for doc in tables(snapshot()).values():
        assert doc["schema_version"] == 1
        assert "ramp" not in doc and all("ramp" not in r for r in doc["remote_regions"])
    # A restore older than the window changes nothing either: same bytes.
    assert tables(snapshot(restored_ago=600)) == tables(snapshot())


def test_restored_region_and_its_peers_carry_the_ramp_and_edges_decode_it() -> None:
    docs = tables(snapshot(restored_ago=20))
    eu, us = docs["eu-west"], docs["us-east"]
    assert (eu["schema_version"], eu["ramp"]) == (2, 0.4)
    assert us["schema_version"] == 2 and "ramp" not in us
    assert [(r["code"], r["ramp"]) for r in us["remote_regions"]] == [("eu-west", 0.4)]
    assert decode_table(orjson.dumps(eu)).ramp == 0.4
    assert decode_table(orjson.dumps(us)).remote_regions[0].ramp == 0.4
    # The split plans only the ramp's share of its capacity.
    full = {r["model"]: r for r in tables(snapshot())["eu-west"]["routes"]}
    ramped = {r["model"]: r for r in eu["routes"]}
    assert ramped["m-8b"]["local_capacity_tokens_per_s"] == pytest.approx(
        0.4 * full["m-8b"]["local_capacity_tokens_per_s"], rel=1e-3
    )


def test_the_later_of_restore_and_recovery_starts_the_ramp() -> None:
    assert tables(snapshot(restored_ago=55, recovered_ago=5))["eu-west"]["ramp"] == 0.2
    assert tables(snapshot(restored_ago=5, recovered_ago=55))["eu-west"]["ramp"] == 0.2
    assert "ramp" not in tables(snapshot(restored_ago=90, recovered_ago=70))["eu-west"]


def test_a_region_that_lost_all_instances_gets_no_traffic_and_no_step_is_scheduled() -> None:
    snap = snapshot(eu_health=(False, False))
    docs = tables(snap)
    assert docs["eu-west"]["ramp"] == 0.0
    assert docs["us-east"]["remote_regions"][0]["ramp"] == 0.0
    assert fleet_plan(snap).next_ramp_change_s is None  # the heartbeat bringing it back does
    # One instance still healthy (or unknown): the region is not down.
    assert "ramp" not in tables(snapshot(eu_health=(False, True)))["eu-west"]


def test_restore_evacuate_restore_within_the_window_starts_again_from_the_first_step() -> None:
    assert tables(snapshot(restored_ago=40))["eu-west"]["ramp"] == 0.6
    evacuated = tables(snapshot(restored_ago=40, status="evacuated"))
    assert evacuated["eu-west"]["instances"] == [] and "ramp" not in evacuated["eu-west"]
    assert evacuated["us-east"]["remote_regions"] == []
    again = snapshot(restored_ago=1)  # the second restore records its own time
    assert tables(again)["eu-west"]["ramp"] == 0.2
    assert fleet_plan(again).next_ramp_change_s == pytest.approx(14.0)


def test_without_a_snapshot_time_nothing_ramps() -> None:
    snap = replace(snapshot(restored_ago=1), now=None)
    assert "ramp" not in tables(snap)["eu-west"]
