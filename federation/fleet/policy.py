"""The fleet's decisions, pure: plain observations in, steps out. The worker's tasks only
observe (database, provisioner listing, HTTP probes), call these, and carry the steps out.

* :func:`health_step` — hysteresis: an instance fails after ``fail_after`` failed probes not
  separated by ``recover_after`` consecutive good ones, so one flap neither fails it nor clears
  a flapping one.
* :func:`instance_steps` — one instance's next lifecycle moves: pending → loading (started) →
  warming (answers) → ready (``/health`` and ``/v1/models`` with its model) → draining →
  stopped, or failed; timeouts per state.
* :func:`replica_plan` — the reconcile diff of a deployment: how many to start, which to stop
  or drain, to match ``desired_replicas``.
* :func:`region_verdict` — evacuate a region whose edges all fell silent or whose instances
  fail beyond a threshold; restore it once stable for a while.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from federation.inventory import lifecycle

SCALE_DOWN = "scale_down"


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    fail_after: int = 3
    recover_after: int = 2


@dataclass(frozen=True, slots=True)
class HealthCount:
    failures: int = 0
    successes: int = 0


def health_step(count: HealthCount, ok: bool, policy: HealthPolicy) -> HealthCount:
    """The counts after one more probe."""
    if not ok:
        return HealthCount(failures=count.failures + 1, successes=0)
    if count.failures == 0:
        return HealthCount()
    successes = count.successes + 1
    if successes >= policy.recover_after:
        return HealthCount()
    return HealthCount(failures=count.failures, successes=successes)


def health_failed(count: HealthCount, policy: HealthPolicy) -> bool:
    return count.failures >= policy.fail_after


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds an instance may stay in a state before the worker gives up on it."""

    loading_s: float = 600.0
    warming_s: float = 300.0
    drain_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Observed:
    """One instance as the worker sees it in one pass."""

    name: str
    state: str
    drain_reason: str
    state_age_s: float
    #: The provisioner lists its engine.
    process: bool
    #: ``/health`` answered 200.
    answers: bool
    #: ``/v1/models`` lists its served model.
    serves_model: bool
    #: Fresh edge reports (newer than the state change) agree it is unhealthy.
    edges_unhealthy: bool
    #: Requests the engine itself runs or queues (its /metrics); None: unknown.
    in_flight: int | None
    #: Every live edge of the region has applied a table without this instance.
    edges_caught_up: bool
    health: HealthCount
    region_active: bool


class Act(StrEnum):
    START = "start"  # provisioner.start, then pending → loading
    MOVE = "move"  # a lifecycle transition to ``target``
    FAIL = "fail"  # → failed, then provisioner.stop
    STOP = "stop"  # → stopped (unless already terminal), then provisioner.stop


@dataclass(frozen=True, slots=True)
class Step:
    instance: str
    act: Act
    target: str = ""
    reason: str = ""


def _walk_up(obs: Observed) -> list[Step]:
    """From loading or warming, as far as the probes allow."""
    steps = []
    state = obs.state
    if state == lifecycle.LOADING and obs.answers:
        steps.append(Step(obs.name, Act.MOVE, lifecycle.WARMING, "answers /health"))
        state = lifecycle.WARMING
    if state == lifecycle.WARMING and obs.answers and obs.serves_model and obs.region_active:
        steps.append(Step(obs.name, Act.MOVE, lifecycle.READY, "/health and /v1/models answer"))
    return steps


def instance_steps(
    obs: Observed, *, timeouts: Timeouts, health: HealthPolicy
) -> tuple[list[Step], HealthCount]:
    """The moves of one instance this pass, and its probe counts after it."""
    name, state = obs.name, obs.state
    if state in lifecycle.TERMINAL_STATES:
        # A failed or stopped instance whose engine still runs (a crash between the two
        # halves of a stop): stop the engine.
        return ([Step(name, Act.STOP, reason="terminal instance")] if obs.process else []), (
            obs.health
        )
    if state == lifecycle.PENDING:
        if obs.process:  # started before a crash: adopt it
            return [Step(name, Act.MOVE, lifecycle.LOADING, "engine found running")], obs.health
        return [Step(name, Act.START, lifecycle.LOADING)], obs.health
    if not obs.process:
        return [Step(name, Act.FAIL, reason="engine process is gone")], obs.health
    if state in (lifecycle.LOADING, lifecycle.WARMING):
        steps = _walk_up(obs)
        limit = timeouts.loading_s if state == lifecycle.LOADING else timeouts.warming_s
        if not steps and obs.region_active and obs.state_age_s > limit:
            steps = [Step(name, Act.FAIL, reason=f"still {state} after {limit:.0f} s")]
        return steps, obs.health
    ok = obs.answers and obs.serves_model and not obs.edges_unhealthy
    count = health_step(obs.health, ok, health)
    if health_failed(count, health):
        return [Step(name, Act.FAIL, reason=f"{count.failures} failed probes (hysteresis)")], count
    if state == lifecycle.DRAINING and obs.drain_reason == SCALE_DOWN:
        # Idle only counts once no edge can send it anything new.
        idle = obs.edges_caught_up and obs.in_flight == 0
        if idle or obs.state_age_s >= timeouts.drain_s:
            why = "drained: nothing in flight" if idle else f"drain timeout {timeouts.drain_s} s"
            return [Step(name, Act.STOP, lifecycle.STOPPED, why)], count
    return [], count


@dataclass(frozen=True, slots=True)
class Replica:
    name: str
    state: str
    drain_reason: str
    in_flight: int
    created_order: int  # higher: newer
    #: Created by the worker; an instance the operator registered counts, but is never
    #: stopped or drained by a scale-down.
    managed: bool = True


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    create: int = 0
    undrain: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()


_COMING = (lifecycle.PENDING, lifecycle.LOADING, lifecycle.WARMING)


def replica_plan(
    replicas: Sequence[Replica], *, desired: int, max_replicas: int, can_place: bool
) -> ReplicaPlan:
    """Match the replicas that count (all live ones but those draining to be stopped) to
    ``desired``: undrain scaled-down ones first (they are warm), then create; or stop the ones
    not serving yet (newest first), then drain ready ones (least in flight first) — of those
    the worker created."""
    counted = [
        r for r in replicas if r.state in lifecycle.LIVE_STATES and r.drain_reason != SCALE_DOWN
    ]
    live = sum(1 for r in replicas if r.state in lifecycle.LIVE_STATES)
    missing = desired - len(counted)
    if missing > 0:
        leaving = [
            r.name
            for r in replicas
            if r.state == lifecycle.DRAINING and r.drain_reason == SCALE_DOWN
        ]
        undrain = tuple(sorted(leaving)[:missing]) if can_place else ()
        room = max(0, max_replicas - live)
        create = min(missing - len(undrain), room) if can_place else 0
        return ReplicaPlan(create=create, undrain=undrain)
    if missing == 0:
        return ReplicaPlan()
    excess = -missing
    ours = [r for r in counted if r.managed]
    not_serving = sorted(
        (r for r in ours if r.state in _COMING or r.state == lifecycle.DRAINING),
        key=lambda r: (r.state == lifecycle.DRAINING, -r.created_order),
    )
    stop = tuple(r.name for r in not_serving[:excess])
    ready = sorted(
        (r for r in ours if r.state == lifecycle.READY),
        key=lambda r: (r.in_flight, -r.created_order),
    )
    drain = tuple(r.name for r in ready[: excess - len(stop)])
    return ReplicaPlan(stop=stop, drain=drain)


@dataclass(frozen=True, slots=True)
class FailoverPolicy:
    #: Every edge of the region silent this long (that ever sent a heartbeat).
    edge_silence_s: float = 15.0
    #: Instances failed within ``failed_window_s``, as a share of those and the serving ones.
    failed_share: float = 0.5
    min_failed: int = 2
    failed_window_s: float = 60.0
    #: Restored after the trouble has been gone this long.
    restore_after_s: float = 30.0


@dataclass(frozen=True, slots=True)
class RegionObserved:
    code: str
    status: str  # Region.Status value
    edge_silence_s: Sequence[float]  # per edge that ever sent a heartbeat: seconds since
    recently_failed: int
    serving: int  # ready, or drained by an evacuation
    auto_evacuated: bool
    stable_for_s: float | None  # None: no stable period started


class Verdict(StrEnum):
    NONE = "none"
    EVACUATE = "evacuate"
    RESTORE = "restore"
    STABLE = "stable"  # the trouble is gone: start (or keep) the stable clock
    UNSTABLE = "unstable"  # still in trouble: reset the clock
    FORGET = "forget"  # the operator restored it: drop the fleet's mark


def region_trouble(obs: RegionObserved, policy: FailoverPolicy) -> str:
    """Why the region should not serve, or '' when nothing says so."""
    silent = obs.edge_silence_s and all(s > policy.edge_silence_s for s in obs.edge_silence_s)
    if silent:
        return f"all {len(obs.edge_silence_s)} edges silent for over {policy.edge_silence_s:g} s"
    total = obs.recently_failed + obs.serving
    if (
        obs.recently_failed >= policy.min_failed
        and total
        and obs.recently_failed / total >= policy.failed_share
    ):
        return (
            f"{obs.recently_failed} of {total} instances failed within {policy.failed_window_s:g} s"
        )
    return ""


def region_verdict(obs: RegionObserved, policy: FailoverPolicy) -> tuple[Verdict, str]:
    """What to do with a region this pass, and why."""
    trouble = region_trouble(obs, policy)
    if obs.status == "active":
        if obs.auto_evacuated:
            return Verdict.FORGET, "restored by an operator"
        return (Verdict.EVACUATE, trouble) if trouble else (Verdict.NONE, "")
    if obs.status != "evacuated" or not obs.auto_evacuated:
        return Verdict.NONE, ""  # an operator's evacuation is the operator's to undo
    if trouble:
        return Verdict.UNSTABLE, trouble
    if obs.stable_for_s is not None and obs.stable_for_s >= policy.restore_after_s:
        return Verdict.RESTORE, f"stable for {obs.stable_for_s:.0f} s"
    return Verdict.STABLE, ""
