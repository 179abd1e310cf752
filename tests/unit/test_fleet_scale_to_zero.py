"""Scale to zero and back, the pure policy: only when opted in, only after the idle time, the
down window and the cooldown, never with anything asked of the deployment; back at once when
an edge holds a request for the cold model."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from federation.fleet.autoscaler import (
    AutoscalePolicy,
    Decision,
    DeploymentLoad,
    Memory,
    ReplicaLoad,
    autoscale_step,
)

POLICY = AutoscalePolicy(down_window_s=60, cooldown_s=120)
AFTER = 300.0


def replica(
    in_flight: int = 0, queued: int = 0, tps: float = 0.0, overflow: int = 0
) -> ReplicaLoad:
    return ReplicaLoad(
        in_flight=in_flight,
        queued=queued,
        kv_cache_usage=0.0,
        tokens_per_s=tps,
        max_concurrency=10,
        full_tokens_per_s=1000.0,
        overflow=overflow,
    )


def dep(
    ready: list[ReplicaLoad],
    *,
    desired: int | None = None,
    after: float | None = AFTER,
    held: int = 0,
    **kw: int,
) -> DeploymentLoad:
    fields = {"min_replicas": 0, "max_replicas": 4, "coming": 0, "unreported": 0, "free_gpus": 8}
    fields.update(kw)
    return DeploymentLoad(
        desired=len(ready) + fields["coming"] if desired is None else desired,
        ready=ready,
        gpus_per_replica=1,
        scale_to_zero_after_s=after,
        held=held,
        **fields,
    )


def run(
    obs: DeploymentLoad, memory: Memory, start: float, end: float, step: float = 5.0
) -> tuple[Decision, float]:
    """Passes every ``step`` seconds from ``start`` until the count changes or ``end``."""
    t = start
    d = autoscale_step(obs, memory, now=t, policy=POLICY)
    while not d.changed(obs.desired) and t < end:
        t += step
        d = autoscale_step(obs, d.memory, now=t, policy=POLICY)
    return d, t


def test_an_idle_last_replica_goes_after_the_idle_time_not_before() -> None:
    d, t = run(dep([replica()]), Memory(), 0, 2000)
    assert d.desired == 0 and t == AFTER, (t, d.reason)
    assert d.reason == "no demand for 300 s: scaled to zero"
    assert d.memory.changed_at == t and d.memory.idle_since is None


def test_the_down_window_and_the_cooldown_still_apply() -> None:
    short = 10.0
    d, t = run(dep([replica()], after=short), Memory(), 0, 2000)
    assert t == POLICY.down_window_s  # the idle time is at least the down window
    d, t = run(dep([replica()]), Memory(changed_at=200.0), 0, 2000)
    assert d.desired == 0 and t == 200.0 + POLICY.cooldown_s
    mid = autoscale_step(
        dep([replica()]),
        replace(d.memory, idle_since=0.0, changed_at=250.0),
        now=AFTER,
        policy=POLICY,
    )
    assert mid.desired == 1 and "cooling down" in mid.reason


def test_any_demand_restarts_the_idle_clock() -> None:
    idle, busy = dep([replica()]), dep([replica(in_flight=1)])
    d = autoscale_step(idle, Memory(), now=0, policy=POLICY)
    d = autoscale_step(idle, d.memory, now=AFTER - 5, policy=POLICY)
    for seen in (replica(in_flight=1), replica(queued=1), replica(tps=3.0), replica(overflow=1)):
        late = autoscale_step(dep([seen]), d.memory, now=AFTER - 1, policy=POLICY)
        assert late.memory.idle_since is None and late.desired == 1
    held = autoscale_step(dep([replica()], held=2), d.memory, now=AFTER - 1, policy=POLICY)
    assert held.memory.idle_since is None
    d = autoscale_step(busy, d.memory, now=AFTER - 1, policy=POLICY)
    d, t = run(idle, d.memory, AFTER, 5000)
    assert d.desired == 0 and t == 2 * AFTER


def test_never_to_zero_without_opting_in_or_above_a_minimum() -> None:
    for obs in (dep([replica()], after=None), dep([replica()], min_replicas=1)):
        d, _ = run(obs, Memory(), 0, 5000)
        assert d.desired == 1


def test_never_to_zero_while_a_replica_is_unreported_or_coming() -> None:
    for obs in (dep([replica()], unreported=1, desired=1), dep([replica()], coming=1, desired=1)):
        d, _ = run(obs, Memory(), 0, 5000)
        assert d.desired == 1


def test_more_than_one_replica_is_scaled_down_one_by_one_first() -> None:
    d, t = run(dep([replica(), replica()]), Memory(), 0, 5000)
    assert d.desired == 1 and "below" in d.reason and t == POLICY.down_window_s
    d, t = run(dep([replica()]), d.memory, t, 5000)
    assert d.desired == 0 and t == AFTER  # idle since 0, the cooldown after 60 s is over


def test_from_zero_one_replica_as_soon_as_a_request_is_held() -> None:
    zero = dep([], desired=0)
    d = autoscale_step(zero, Memory(idle_since=5.0, load=0.2), now=10, policy=POLICY)
    assert d.desired == 0 and d.reason == "at zero, no demand"
    d = autoscale_step(replace(zero, held=3), d.memory, now=11, policy=POLICY)
    assert d.desired == 1 and "3 request(s) held" in d.reason
    assert d.memory == Memory(changed_at=11)
    full = autoscale_step(replace(zero, held=3, free_gpus=0), Memory(), now=12, policy=POLICY)
    assert full.desired == 0 and "no room" in full.reason
    capped = autoscale_step(replace(zero, held=3, max_replicas=0), Memory(), now=12, policy=POLICY)
    assert capped.desired == 0


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2)),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 2),
    st.floats(0, 10_000),
    st.floats(0, 10_000),
)
def test_never_zero_while_anything_is_asked(
    loads: list[tuple[int, int, int, int]], coming: int, idle_since: float, now_after: float
) -> None:
    ready = [replica(in_flight=a, queued=b, overflow=c) for a, b, c, _ in loads]
    held = loads[0][3]
    obs = dep(ready, coming=coming, held=held)
    memory = Memory(idle_since=idle_since, changed_at=0.0)
    d = autoscale_step(obs, memory, now=idle_since + now_after, policy=POLICY)
    asked = held or coming or any(a or b or c for a, b, c, _ in loads)
    if asked:
        assert d.desired >= 1
