"""The scale benchmark's compile half on a tiny fleet: it runs the publisher's own compile,
finds the tables one instance's change touches, and judges the targets from its figures."""

from __future__ import annotations

from bench.scale import Step, fleet_at, judge, measure_step, one_instance_drains

#: Eight regions: one in each jurisdiction the synthetic tenants may name.
TINY = {"regions": 8, "instances": 60, "tenants": 60, "edges": 12, "models": 3}


def test_a_step_is_the_base_times_its_factor_with_edges_spread_over_regions() -> None:
    step = Step.of(2, TINY)
    assert (step.regions, step.instances, step.tenants, step.edges) == (16, 120, 120, 24)
    fleet = fleet_at(step, seed=3)
    assert sorted(len(r.edges) for r in fleet.regions) == [1] * 8 + [2] * 8
    assert len(fleet.tenants) == 120


def test_one_instance_drains_and_nothing_else_changes() -> None:
    fleet = fleet_at(Step.of(1, TINY), seed=3)
    after, region = one_instance_drains(fleet)
    changed = [(a, b) for a, b in zip(fleet.instances, after.instances, strict=True) if a != b]
    assert len(changed) == 1
    before_row, after_row = changed[0]
    assert (before_row.state, after_row.state, after_row.region) == ("ready", "draining", region)


def test_measuring_a_step_reports_sizes_receivers_and_judges_the_targets() -> None:
    results = [measure_step(Step.of(f, TINY), seed=3, runs=1) for f in (1, 2)]
    first = results[0]
    assert first["regions_changed"] >= 1  # the draining instance's own region at least
    assert first["table_bytes_max"] >= first["table_bytes_median"] > 0
    assert first["edges_receiving"] <= first["edges"]
    lines = judge(results, None)
    assert len(lines) == 2 and all(("met" in line) for line in lines)
