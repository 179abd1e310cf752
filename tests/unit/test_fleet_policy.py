"""The fleet's pure decisions: hysteresis, lifecycle steps, the reconcile diff, region failover."""

from __future__ import annotations

from dataclasses import replace

import pytest

from federation.fleet.policy import (
    Act,
    FailoverPolicy,
    HealthCount,
    HealthPolicy,
    Observed,
    RegionObserved,
    Replica,
    Step,
    Timeouts,
    Verdict,
    health_failed,
    health_step,
    instance_steps,
    region_verdict,
    replica_plan,
)

POLICY = HealthPolicy(fail_after=3, recover_after=2)


def run(probes: str) -> HealthCount:
    count = HealthCount()
    for probe in probes:
        count = health_step(count, probe == "+", POLICY)
    return count


@pytest.mark.parametrize(
    ("probes", "failed"),
    [
        ("---", True),  # N consecutive failures
        ("--", False),
        ("-", False),  # one flap fails nothing
        ("--++-", False),  # M successes cleared the first two
        ("-+-+-", True),  # flapping: failures never separated by M successes
        ("--+-", True),
        ("++++", False),
    ],
)
def test_an_instance_fails_after_n_failures_not_cleared_by_m_successes(
    probes: str, failed: bool
) -> None:
    assert health_failed(run(probes), POLICY) is failed


def test_m_successes_clear_the_count() -> None:
    assert run("--++") == HealthCount()
    assert run("--+") == HealthCount(failures=2, successes=1)


def obs(state: str, **kw: object) -> Observed:
    base = Observed(
        name="i1",
        state=state,
        drain_reason="",
        state_age_s=1.0,
        process=True,
        answers=True,
        serves_model=True,
        edges_unhealthy=False,
        in_flight=None,
        edges_caught_up=False,
        health=HealthCount(),
        region_active=True,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


DEFAULT_TIMEOUTS = Timeouts()


def steps(o: Observed, timeouts: Timeouts = DEFAULT_TIMEOUTS) -> list[Step]:
    return instance_steps(o, timeouts=timeouts, health=POLICY)[0]


def test_pending_is_started_unless_its_engine_already_runs() -> None:
    assert steps(obs("pending", process=False)) == [Step("i1", Act.START, "loading")]
    # Started before a crash: adopted, not started twice.
    assert [s.act for s in steps(obs("pending", process=True))] == [Act.MOVE]


def test_loading_walks_up_as_far_as_the_probes_allow() -> None:
    assert steps(obs("loading", answers=False, serves_model=False)) == []
    walked = steps(obs("loading", serves_model=False))
    assert [(s.act, s.target) for s in walked] == [(Act.MOVE, "warming")]
    walked = steps(obs("loading"))
    assert [s.target for s in walked] == ["warming", "ready"]
    # In an evacuated region an engine warms but does not become ready (nor time out).
    walked = steps(obs("warming", region_active=False, state_age_s=10_000))
    assert walked == []


def test_timeouts_per_state_fail_a_stuck_engine() -> None:
    t = Timeouts(loading_s=60, warming_s=30)
    assert steps(obs("loading", answers=False, state_age_s=59), t) == []
    (step,) = steps(obs("loading", answers=False, state_age_s=61), t)
    assert step.act == Act.FAIL and "loading" in step.reason
    (step,) = steps(obs("warming", serves_model=False, state_age_s=31), t)
    assert step.act == Act.FAIL


def test_a_gone_engine_fails_at_once_and_a_terminal_ones_engine_is_stopped() -> None:
    (step,) = steps(obs("ready", process=False))
    assert step.act == Act.FAIL and "gone" in step.reason
    assert [s.act for s in steps(obs("failed", process=True))] == [Act.STOP]
    assert steps(obs("stopped", process=False)) == []


def test_a_ready_instance_fails_through_hysteresis_from_probes_or_edges() -> None:
    result, count = instance_steps(
        obs("ready", answers=False, health=HealthCount(failures=1)),
        timeouts=Timeouts(),
        health=POLICY,
    )
    assert result == [] and count == HealthCount(failures=2)
    result, _ = instance_steps(
        obs("ready", edges_unhealthy=True, health=count), timeouts=Timeouts(), health=POLICY
    )
    assert [s.act for s in result] == [Act.FAIL]


def test_a_scaled_down_instance_stops_once_edges_know_and_the_engine_is_idle() -> None:
    t = Timeouts(drain_s=60)
    draining = obs("draining", drain_reason="scale_down", state_age_s=5)
    # An edge still on a table that lists it may send it a request: not yet, however idle.
    assert steps(replace(draining, in_flight=0, edges_caught_up=False), t) == []
    assert steps(replace(draining, in_flight=2, edges_caught_up=True), t) == []
    assert steps(replace(draining, in_flight=None, edges_caught_up=True), t) == []
    (step,) = steps(replace(draining, in_flight=0, edges_caught_up=True), t)
    assert (step.act, step.target) == (Act.STOP, "stopped")
    (step,) = steps(replace(draining, in_flight=5, state_age_s=61), t)
    assert "timeout" in step.reason
    # An operator's or an evacuation's drain is not the fleet's to end.
    evacuated = obs("draining", drain_reason="evacuation", in_flight=0, state_age_s=99)
    assert steps(replace(evacuated, edges_caught_up=True), t) == []


def r(name: str, state: str, order: int, *, reason: str = "", in_flight: int = 0) -> Replica:
    return Replica(name, state, reason, in_flight, order)


def test_the_replica_plan_creates_the_missing_within_max_and_where_placeable() -> None:
    replicas = [r("a", "ready", 0), r("b", "failed", 1)]
    assert replica_plan(replicas, desired=3, max_replicas=5, can_place=True).create == 2
    assert replica_plan(replicas, desired=3, max_replicas=2, can_place=True).create == 1
    assert replica_plan(replicas, desired=3, max_replicas=5, can_place=False).create == 0
    assert replica_plan(replicas, desired=1, max_replicas=5, can_place=True) == replica_plan(
        [], desired=0, max_replicas=0, can_place=True
    )


def test_scale_up_undrains_a_scaled_down_replica_before_creating() -> None:
    replicas = [r("a", "ready", 0), r("b", "draining", 1, reason="scale_down")]
    plan = replica_plan(replicas, desired=3, max_replicas=3, can_place=True)
    assert plan.undrain == ("b",) and plan.create == 1


def test_scale_down_stops_what_does_not_serve_yet_then_drains_the_least_busy() -> None:
    replicas = [
        r("a", "ready", 0, in_flight=5),
        r("b", "ready", 1, in_flight=0),
        r("c", "loading", 2),
        r("d", "ready", 3, in_flight=2),
    ]
    plan = replica_plan(replicas, desired=1, max_replicas=4, can_place=True)
    assert plan.stop == ("c",) and plan.drain == ("b", "d")
    # Draining ones to be stopped no longer count: no second drain for the same excess.
    after = [*replicas[:1], r("b", "draining", 1, reason="scale_down"), r("d", "ready", 3)]
    assert replica_plan(after, desired=2, max_replicas=4, can_place=True).drain == ()


REGION_POLICY = FailoverPolicy(
    edge_silence_s=10, failed_share=0.5, min_failed=2, failed_window_s=60, restore_after_s=30
)


def region(**kw: object) -> RegionObserved:
    base = RegionObserved(
        code="eu",
        status="active",
        edge_silence_s=[1.0, 2.0],
        recently_failed=0,
        serving=4,
        auto_evacuated=False,
        stable_for_s=None,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_a_region_whose_edges_all_fall_silent_is_evacuated() -> None:
    assert region_verdict(region(), REGION_POLICY)[0] == Verdict.NONE
    assert region_verdict(region(edge_silence_s=[11.0, 2.0]), REGION_POLICY)[0] == Verdict.NONE
    verdict, why = region_verdict(region(edge_silence_s=[11.0, 12.0]), REGION_POLICY)
    assert verdict == Verdict.EVACUATE and "silent" in why
    # A region that never had an edge heard from has not fallen silent.
    assert region_verdict(region(edge_silence_s=[]), REGION_POLICY)[0] == Verdict.NONE


def test_a_region_whose_instances_fail_beyond_the_threshold_is_evacuated() -> None:
    assert region_verdict(region(recently_failed=1, serving=0), REGION_POLICY)[0] == Verdict.NONE
    assert region_verdict(region(recently_failed=2, serving=3), REGION_POLICY)[0] == Verdict.NONE
    verdict, why = region_verdict(region(recently_failed=2, serving=2), REGION_POLICY)
    assert verdict == Verdict.EVACUATE and "failed" in why


def test_an_automatic_evacuation_is_restored_only_after_stable_for_the_configured_time() -> None:
    evac = region(status="evacuated", auto_evacuated=True)
    silent = replace(evac, edge_silence_s=[20.0])
    assert region_verdict(silent, REGION_POLICY)[0] == Verdict.UNSTABLE
    assert region_verdict(evac, REGION_POLICY)[0] == Verdict.STABLE
    assert region_verdict(replace(evac, stable_for_s=29), REGION_POLICY)[0] == Verdict.STABLE
    assert region_verdict(replace(evac, stable_for_s=30), REGION_POLICY)[0] == Verdict.RESTORE
    # An operator's evacuation is left alone; an operator's restore drops the fleet's mark.
    assert region_verdict(replace(evac, auto_evacuated=False, stable_for_s=99), REGION_POLICY)[
        0
    ] == (Verdict.NONE)
    assert region_verdict(region(auto_evacuated=True), REGION_POLICY)[0] == Verdict.FORGET


def test_a_scale_down_never_picks_an_instance_the_operator_registered() -> None:
    by_hand = Replica("hand", "ready", "", 0, 0, managed=False)
    ours = r("ours", "ready", 1, in_flight=9)
    plan = replica_plan([by_hand, ours], desired=1, max_replicas=2, can_place=True)
    assert plan.drain == ("ours",)
    assert replica_plan([by_hand], desired=0, max_replicas=2, can_place=True) == replica_plan(
        [], desired=0, max_replicas=2, can_place=True
    )
    # It counts as a replica all the same.
    assert replica_plan([by_hand], desired=1, max_replicas=2, can_place=True).create == 0
