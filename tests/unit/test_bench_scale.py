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
    ratio = results[-1]["change_compile_cpu_s"] / first["change_compile_cpu_s"]
    seconds = results[-1]["change_compile_s"] + results[-1]["serve_cpu_per_change_s"]
    assert [line.rsplit(": ", 1)[1] for line in lines] == [
        "met" if ratio <= 2 else "NOT met",
        "met" if seconds <= 1 else "NOT met",
    ]


def _figures(factor: int, cpu_s: float, wall_s: float, serve_s: float) -> dict[str, float]:
    return {
        "factor": factor,
        "edges": 12 * factor,
        "change_compile_cpu_s": cpu_s,
        "change_compile_s": wall_s,
        "serve_cpu_per_change_s": serve_s,
    }


def test_the_verdicts_follow_the_figures() -> None:
    met = judge([_figures(1, 0.1, 0.1, 0.1), _figures(8, 0.2, 0.5, 0.4)], None)
    assert [line.rsplit(": ", 1)[1] for line in met] == ["met", "met"]
    assert "costs 2.0x" in met[0] and "0.9 s" in met[1]
    missed = judge([_figures(1, 0.1, 0.1, 0.1), _figures(8, 0.21, 0.7, 0.4)], None)
    assert [line.rsplit(": ", 1)[1] for line in missed] == ["NOT met", "NOT met"]
    ingest = {"judged": {"heartbeats per second per process >= 2000": "NOT met (44)"}}
    with_ingest = judge([_figures(1, 0.1, 0.1, 0.1), _figures(8, 0.2, 0.5, 0.4)], ingest)
    assert with_ingest[2] == "- heartbeats per second per process >= 2000: NOT met (44)"
