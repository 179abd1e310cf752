"""The autoscaler's pure policy: up fast, down slowly, within the bounds, no flapping."""

from __future__ import annotations

import itertools
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from federation.fleet.autoscaler import (
    AutoscalePolicy,
    DeploymentLoad,
    Memory,
    ReplicaLoad,
    autoscale_step,
    replica_utilisation,
)

POLICY = AutoscalePolicy(down_window_s=60, cooldown_s=120)


def load(in_flight: int = 0, queued: int = 0, kv: float = 0.0, tps: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(
        in_flight=in_flight,
        queued=queued,
        kv_cache_usage=kv,
        tokens_per_s=tps,
        max_concurrency=10,
        full_tokens_per_s=1000.0,
    )


def deployment(
    ready: list[ReplicaLoad], *, desired: int | None = None, **kw: int
) -> DeploymentLoad:
    fields: dict[str, int] = {
        "min_replicas": 1,
        "max_replicas": 8,
        "coming": 0,
        "unreported": 0,
        "free_gpus": 16,
        "gpus_per_replica": 1,
    }
    fields.update(kw)
    return DeploymentLoad(
        desired=len(ready) + fields["coming"] if desired is None else desired,
        ready=ready,
        **fields,
    )


def test_utilisation_is_the_highest_pressure() -> None:
    assert replica_utilisation(load(in_flight=5)) == 0.5
    assert replica_utilisation(load(in_flight=10, queued=5)) == 1.5  # queueing: above 1
    assert replica_utilisation(load(in_flight=1, kv=0.8)) == 0.8
    assert replica_utilisation(load(in_flight=1, tps=900)) == 0.9


def test_scales_up_at_once_straight_to_the_count_that_restores_the_target() -> None:
    # Two replicas at 100 %: 2.0 / 0.65 -> 4 replicas, in one step, no delay.
    d = autoscale_step(deployment([load(in_flight=10)] * 2), Memory(), now=0, policy=POLICY)
    assert d.desired == 4 and d.memory.changed_at == 0 and "above" in d.reason


def test_one_busy_instant_is_smoothed_away_a_lasting_load_is_not() -> None:
    calm = deployment([load(in_flight=6)] * 2)  # 60 %
    busy = deployment([load(in_flight=9)] * 2)  # 90 %: above the band, below panic
    d = autoscale_step(calm, Memory(), now=0, policy=POLICY)
    d = autoscale_step(busy, d.memory, now=5, policy=POLICY)
    assert d.desired == 2 and d.reason == "within the band"
    d = autoscale_step(calm, d.memory, now=10, policy=POLICY)
    assert d.desired == 2
    # The same 90 % for a while: up, once the smoothed load crosses the band.
    t = 10
    while d.desired == 2:
        t += 5
        assert t <= 60, "a lasting load must scale up within a few time constants"
        d = autoscale_step(busy, d.memory, now=t, policy=POLICY)
    assert d.desired == 3 and "above" in d.reason


def test_every_slot_busy_scales_up_at_once_without_waiting_for_the_smoothing() -> None:
    d = autoscale_step(deployment([load(in_flight=2)] * 2), Memory(), now=0, policy=POLICY)
    d = autoscale_step(deployment([load(in_flight=10)] * 2), d.memory, now=2, policy=POLICY)
    assert d.desired == 4 and "every slot busy" in d.reason


def test_a_burst_of_tokens_counted_as_streams_end_is_smoothed_not_a_panic() -> None:
    """Edges count a stream's output when it ends: long streams ending together put a rate
    above the replica's full throughput into one heartbeat. Half its slots are busy, so that
    is not "every slot busy"; the burst goes through the smoothing like any rate."""
    calm = deployment([load(in_flight=5)])
    first = autoscale_step(calm, Memory(), now=0, policy=POLICY)
    burst = autoscale_step(
        deployment([load(in_flight=5, tps=1370)]), first.memory, now=1, policy=POLICY
    )
    assert burst.desired == 1 and "every slot busy" not in burst.reason
    # Slots all taken (or the KV cache full) right now is a panic whatever the rate.
    full = autoscale_step(deployment([load(in_flight=10)]), first.memory, now=1, policy=POLICY)
    kv_full = autoscale_step(
        deployment([load(in_flight=3, kv=1.0)]), first.memory, now=1, policy=POLICY
    )
    assert full.desired == kv_full.desired == 2
    assert "every slot busy" in full.reason and "every slot busy" in kv_full.reason


def test_requests_spilled_for_want_of_a_slot_count_as_busy_slots() -> None:
    """A region whose edges send what does not fit to other regions is full, not at 75 %: the
    overflow its edges report makes every slot busy, so it scales up at once."""
    calm = deployment([load(in_flight=2)])
    spilling = deployment([replace(load(in_flight=8), overflow=2)])  # 8 of 10 here, 2 away
    first = autoscale_step(calm, Memory(), now=0, policy=POLICY)
    d = autoscale_step(spilling, first.memory, now=2, policy=POLICY)
    assert d.desired == 2 and "every slot busy" in d.reason
    # The same local load without its overflow is 80 %: it waits for the smoothing.
    without = autoscale_step(deployment([load(in_flight=8)]), first.memory, now=2, policy=POLICY)
    assert without.desired == 1


def test_replicas_coming_count_so_a_persisting_load_starts_no_more() -> None:
    obs = deployment([load(in_flight=10)] * 2, coming=2)
    d = autoscale_step(obs, Memory(changed_at=0), now=5, policy=POLICY)
    assert d.desired == 4 and "coming" in d.reason


def test_scale_up_stops_at_max_replicas_and_at_the_pools_free_gpus() -> None:
    hot = [load(in_flight=10, queued=10)] * 2  # 4.0 -> 7 replicas wanted
    capped = deployment(hot, max_replicas=5)
    assert autoscale_step(capped, Memory(), now=0, policy=POLICY).desired == 5
    # TP 2 and 5 free GPUs: room for two more replicas.
    obs = deployment(hot, free_gpus=5, gpus_per_replica=2)
    assert autoscale_step(obs, Memory(), now=0, policy=POLICY).desired == 4


def test_scales_down_one_at_a_time_after_the_window_and_the_cooldown() -> None:
    idle = deployment([load(in_flight=1)] * 4)
    memory = Memory(changed_at=0)
    d = autoscale_step(idle, memory, now=10, policy=POLICY)
    assert d.desired == 4 and d.memory.low_since == 10 and "window" in d.reason
    d = autoscale_step(idle, d.memory, now=80, policy=POLICY)  # window over, cooldown not
    assert d.desired == 4 and "cooling" in d.reason
    d = autoscale_step(idle, d.memory, now=130, policy=POLICY)
    assert d.desired == 3 and (d.memory.low_since, d.memory.changed_at) == (None, 130)
    # The next one needs a whole new window.
    smaller = deployment([load(in_flight=1)] * 3)
    d = autoscale_step(smaller, d.memory, now=131, policy=POLICY)
    assert d.desired == 3


def test_the_down_window_times_a_spare_replica_not_merely_a_load_below_the_band() -> None:
    # Two replicas at 56 %: below the band, but one replica could not carry it at 65 %.
    d = autoscale_step(
        deployment([load(in_flight=4), load(in_flight=5)]), Memory(), now=0, policy=POLICY
    )
    assert d.reason == "below the band, no replica to spare" and d.memory.low_since is None
    # Long after, the load dips so that one replica is spare: a whole window starts now.
    smaller = deployment([load(in_flight=2)] * 2)
    d = autoscale_step(smaller, replace(d.memory, load=None), now=1000, policy=POLICY)
    assert d.desired == 2 and d.memory.low_since == 1000 and "window" in d.reason


def test_a_load_back_in_the_band_resets_the_down_window() -> None:
    d = autoscale_step(deployment([load(in_flight=1)] * 2), Memory(), now=0, policy=POLICY)
    assert d.memory.low_since == 0
    d = autoscale_step(
        deployment([load(in_flight=13)] * 1 + [load()]), d.memory, now=300, policy=POLICY
    )
    assert d.memory.low_since is None and d.reason == "within the band"


def test_never_scales_down_while_replicas_are_coming_or_load_is_unknown() -> None:
    coming = deployment([load()] * 2, coming=1)
    assert autoscale_step(coming, Memory(low_since=0), now=1000, policy=POLICY).desired == 3
    unknown = deployment([load()] * 2, unreported=1, desired=3)
    d = autoscale_step(unknown, Memory(low_since=0), now=1000, policy=POLICY)
    assert d.desired == 3 and d.reason == "load not reported"
    none = deployment([], desired=2)
    assert autoscale_step(none, Memory(), now=1000, policy=POLICY).desired == 2


def test_min_or_max_moved_under_the_count_is_applied() -> None:
    obs = deployment([load(in_flight=6)] * 4, max_replicas=3)
    assert autoscale_step(obs, Memory(), now=0, policy=POLICY).desired == 3
    obs = deployment([load(in_flight=6)] * 1, min_replicas=2, desired=1)
    assert autoscale_step(obs, Memory(), now=0, policy=POLICY).desired == 2


replica_loads = st.builds(
    ReplicaLoad,
    in_flight=st.integers(0, 64),
    queued=st.integers(0, 64),
    kv_cache_usage=st.floats(0, 1),
    tokens_per_s=st.floats(0, 5000),
    max_concurrency=st.integers(1, 64),
    full_tokens_per_s=st.floats(1, 5000),
)


@st.composite
def observations(draw: st.DrawFn) -> DeploymentLoad:
    low = draw(st.integers(0, 4))
    high = draw(st.integers(max(1, low), 12))
    desired = draw(st.integers(low, high))
    coming = draw(st.integers(0, desired))
    ready = draw(st.lists(replica_loads, min_size=0, max_size=desired - coming))
    return DeploymentLoad(
        desired=desired,
        min_replicas=low,
        max_replicas=high,
        coming=coming,
        ready=ready,
        unreported=draw(st.integers(0, 1)),
        free_gpus=draw(st.integers(-4, 32)),
        gpus_per_replica=draw(st.integers(1, 8)),
    )


memories = st.builds(
    Memory,
    low_since=st.none() | st.floats(0, 1000),
    changed_at=st.none() | st.floats(0, 1000),
    load=st.none() | st.floats(0, 100),
    observed_at=st.none() | st.floats(0, 1000),
)


@settings(max_examples=400)
@given(obs=observations(), memory=memories, now=st.floats(1000, 5000))
def test_never_below_min_above_max_or_beyond_the_free_gpus(
    obs: DeploymentLoad, memory: Memory, now: float
) -> None:
    d = autoscale_step(obs, memory, now=now, policy=POLICY)
    assert obs.min_replicas <= d.desired <= obs.max_replicas
    if d.desired > obs.desired:
        extra = d.desired - max(obs.desired, obs.min_replicas)
        assert extra * obs.gpus_per_replica <= max(0, obs.free_gpus)
    if d.desired < obs.desired and obs.desired <= obs.max_replicas:
        assert d.desired == obs.desired - 1  # down one at a time
    if obs.desired >= 1 and obs.max_replicas >= 1:
        assert d.desired >= 1  # never to zero on its own: nothing would bring it back


@settings(max_examples=200)
@given(
    replicas=st.integers(1, 8),
    in_flight=st.integers(0, 10),
    kv=st.floats(0, 1),
    start=st.integers(1, 8),
)
def test_a_steady_load_converges_without_flapping(
    replicas: int, in_flight: int, kv: float, start: int
) -> None:
    """A constant total load, spread over whatever replicas there are: the count moves in one
    direction only and settles; a load whose mean is in the band never moves it."""
    total = replicas * replica_utilisation(load(in_flight=in_flight, kv=kv))
    count, memory, seen = start, Memory(), [start]
    for tick in range(60):
        per = total / count
        ready = [ReplicaLoad(0, 0, 0.0, per * 1000, 10, 1000.0)] * count
        obs = deployment(ready, max_replicas=16, free_gpus=16)
        d = autoscale_step(obs, memory, now=tick * 30.0, policy=POLICY)
        count, memory = d.desired, d.memory
        seen.append(count)
    steps = [b - a for a, b in itertools.pairwise(seen) if b != a]
    assert all(s > 0 for s in steps) or all(s < 0 for s in steps)
    assert seen[-1] == seen[-2] == seen[-10]
    if POLICY.low <= total / start <= POLICY.high:
        assert set(seen) == {start}
