"""How many replicas a deployment should have, pure: the load its edges report in, a replica
count out.

A replica's *utilisation* is the highest of three pressures the edges report for it (the
heartbeat, ``docs/distribution.md``): requests it runs or that wait for it — or that the edges
sent to another region for want of a slot here (``overflow``) — against the requests it runs at
once (``max-num-seqs``), its KV-cache usage, and its token throughput
against what it sustains at full load. Their sum over the ready replicas is the deployment's
*load* (in replicas' worth); the seeds' rule is to run at 60-70 %, not 100 %, so the count that
brings it back to the target (65 %) is ``ceil(load / target)``.

A report is a snapshot (requests in flight at that instant), so the load is smoothed
(exponentially, ``smoothing_s``) before it is compared with the band: one busy instant does not
add a replica that the cooldown then keeps for minutes.

* Above the band (smoothed), or every slot (or the KV cache) taken right now (``panic``:
  the next requests would queue and their time to first token grow): scale up at once,
  straight to the count (a cold start takes minutes, waiting only makes the queue longer),
  within ``max_replicas`` and the pool's free GPUs; replicas already coming (pending,
  loading, warming) count, so a load that persists while they warm does not start more.
* Below the band: scale down one replica at a time, and only once one has been spare (the
  others carry the load at the target) for ``down_window_s`` and no change was made for
  ``cooldown_s``; never while a replica is still coming. One replica fewer keeps the mean at
  or under the target, so a scale-down never makes the next pass scale up again (no
  flapping).
* Inside the band: nothing changes.
* To zero and back (opt-in, ``scale_to_zero_after_s`` with ``min_replicas`` 0): the last
  replica goes once nothing was asked of it (nothing in flight, queued, spilled or sent, and no
  request held for it) for that long — and at least the down window — and no change was made
  for the cooldown; drained like any scale-down, so never while serving. A deployment at zero
  comes back to one replica as soon as an edge reports a request it holds (or refused) for the
  cold model: the edges hold the first requests while it warms (``docs/operations.md``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

#: Utilisations this close to a band's edge count as on it (sums of floats are not exact).
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    target: float = 0.65
    low: float = 0.60
    high: float = 0.70
    #: Seconds a replica must have been spare (load below ``low``, the others enough at the
    #: target) before it is removed.
    down_window_s: float = 60.0
    #: Seconds after any change before a replica is removed.
    cooldown_s: float = 120.0
    #: Time constant of the load's exponential smoothing, seconds (0: none).
    smoothing_s: float = 20.0
    #: Utilisation of this instant at which it scales up without waiting for the smoothing.
    panic: float = 1.0


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What the edges reported of one ready replica (summed over the edges, KV the highest)."""

    in_flight: int
    queued: int
    kv_cache_usage: float
    tokens_per_s: float
    #: Requests it runs at once (vLLM ``max-num-seqs``).
    max_concurrency: int
    #: Prompt plus generated tokens per second it sustains at full load.
    full_tokens_per_s: float
    #: Its share of the requests the edges sent to other regions for want of capacity here:
    #: demand that would queue for it if the edges could not spill.
    overflow: int = 0


def replica_occupancy(load: ReplicaLoad) -> float:
    """What it holds right now: the higher of its slots and its KV cache in use (1.0: the next
    request waits; above 1 when requests queue)."""
    concurrency = (load.in_flight + load.queued + load.overflow) / max(1, load.max_concurrency)
    return max(concurrency, min(1.0, max(0.0, load.kv_cache_usage)))


def replica_utilisation(load: ReplicaLoad) -> float:
    """The higher of its occupancy and its throughput pressure (1.0: saturated)."""
    throughput = load.tokens_per_s / load.full_tokens_per_s if load.full_tokens_per_s > 0 else 0.0
    return max(replica_occupancy(load), throughput)


@dataclass(frozen=True, slots=True)
class Memory:
    """What the policy remembers between passes (seconds on one clock, None: never)."""

    #: Since when a replica is spare (reset as soon as none is).
    low_since: float | None = None
    #: When the policy last changed the replica count.
    changed_at: float | None = None
    #: The smoothed load (sum of the ready replicas' utilisations) and when it was observed.
    load: float | None = None
    observed_at: float | None = None
    #: Since when nothing at all was asked of the deployment (scale to zero's clock).
    idle_since: float | None = None


@dataclass(frozen=True, slots=True)
class DeploymentLoad:
    """One deployment as the autoscaler sees it in one pass."""

    #: ``desired_replicas`` now.
    desired: int
    min_replicas: int
    max_replicas: int
    #: Replicas still coming up (pending, loading, warming).
    coming: int
    #: One entry per ready replica with a fresh report.
    ready: Sequence[ReplicaLoad]
    #: Ready replicas no edge reported on recently (their load is unknown).
    unreported: int
    #: GPUs of the pool no deployment claims, and GPUs one replica takes (its TP size).
    free_gpus: int
    gpus_per_replica: int
    #: Seconds without demand after which the last replica goes (None: never to zero).
    scale_to_zero_after_s: float | None = None
    #: Requests the region's edges hold (or refused) for the model while it has no ready
    #: instance (fresh heartbeats): demand no replica report shows.
    held: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    memory: Memory
    utilisation: float | None
    reason: str

    def changed(self, before: int) -> bool:
        return self.desired != before


def _bounded(count: int, obs: DeploymentLoad) -> int:
    """``count`` within min/max, and no more new replicas than the pool's free GPUs hold."""
    room = obs.desired + max(0, obs.free_gpus) // max(1, obs.gpus_per_replica)
    upper = max(obs.min_replicas, min(obs.max_replicas, max(obs.desired, room)))
    return max(obs.min_replicas, min(count, upper))


def smoothed_load(load: float, memory: Memory, *, now: float, smoothing_s: float) -> float:
    """The exponentially smoothed load after observing ``load`` at ``now``."""
    if memory.load is None or memory.observed_at is None or smoothing_s <= 0:
        return load
    weight = 1.0 - math.exp(-max(0.0, now - memory.observed_at) / smoothing_s)
    return memory.load + weight * (load - memory.load)


def autoscale_step(
    obs: DeploymentLoad, memory: Memory, *, now: float, policy: AutoscalePolicy
) -> Decision:
    """The replica count for this pass, what to remember, and why."""
    clamped = _bounded(obs.desired, obs)
    if clamped != obs.desired:  # min or max moved under it
        return Decision(
            clamped,
            replace(memory, low_since=None, idle_since=None, changed_at=now),
            None,
            f"kept within {obs.min_replicas}-{obs.max_replicas}",
        )
    if obs.desired == 0:
        return _from_zero(obs, memory, now=now)
    return _to_zero(obs, memory, _step(obs, memory, now=now, policy=policy), now, policy)


def _from_zero(obs: DeploymentLoad, memory: Memory, *, now: float) -> Decision:
    """At zero: one replica as soon as an edge holds a request for the model."""
    rest = replace(memory, low_since=None, idle_since=None)
    if obs.held <= 0:
        return Decision(0, rest, None, "at zero, no demand")
    wanted = _bounded(1, obs)
    if wanted == 0:
        return Decision(0, rest, None, f"{obs.held} request(s) held, no room to start a replica")
    why = f"{obs.held} request(s) held for the cold model: scaled from zero"
    # A fresh start: no smoothed load of the replicas that went, the cooldown from now.
    return Decision(wanted, Memory(changed_at=now), None, why)


def _idle(obs: DeploymentLoad) -> bool:
    """Nothing at all asked of it: every replica reported, none with anything in flight,
    queued, spilled or sent lately, no request held for it, none coming."""
    return (
        bool(obs.ready)
        and not obs.unreported
        and not obs.coming
        and obs.held <= 0
        and all(r.in_flight + r.queued + r.overflow == 0 and r.tokens_per_s <= 0 for r in obs.ready)
    )


def _to_zero(
    obs: DeploymentLoad, memory: Memory, decision: Decision, now: float, policy: AutoscalePolicy
) -> Decision:
    """``decision``, or zero replicas when the last one has been idle long enough."""
    after = obs.scale_to_zero_after_s
    if after is None or obs.min_replicas != 0 or not _idle(obs):
        return replace(decision, memory=replace(decision.memory, idle_since=None))
    since = memory.idle_since if memory.idle_since is not None else now
    kept = replace(decision, memory=replace(decision.memory, idle_since=since))
    if decision.changed(obs.desired) or obs.desired != 1:
        return kept  # more than one: the usual scale-down removes them one by one first
    idle_s = now - since
    if idle_s < max(after, policy.down_window_s):
        return kept
    if memory.changed_at is not None and now - memory.changed_at < policy.cooldown_s:
        return replace(kept, reason="idle, cooling down before scaling to zero")
    why = f"no demand for {idle_s:.0f} s: scaled to zero"
    rest = replace(decision.memory, low_since=None, idle_since=None, changed_at=now)
    return Decision(0, rest, decision.utilisation, why)


def _step(obs: DeploymentLoad, memory: Memory, *, now: float, policy: AutoscalePolicy) -> Decision:
    """The band policy for a deployment with at least one replica wanted."""
    if not obs.ready or obs.unreported:
        # Nothing (or not everything) serving reports yet: its load is unknown, hold still.
        return Decision(obs.desired, replace(memory, low_since=None), None, "load not reported")
    instant = sum(replica_utilisation(r) for r in obs.ready)
    load = smoothed_load(instant, memory, now=now, smoothing_s=policy.smoothing_s)
    seen = replace(memory, load=load, observed_at=now)
    count = len(obs.ready)
    mean = load / count
    # Only what is held right now: a token rate is counted as requests end (a long stream's
    # output lands in one heartbeat), so it goes through the smoothing, never straight up.
    occupied = sum(replica_occupancy(r) for r in obs.ready)
    panic = occupied / count >= policy.panic - _EPS
    if mean > policy.high + _EPS or panic:
        needed = max(1, math.ceil(max(load, occupied if panic else 0.0) / policy.target - _EPS))
        wanted = _bounded(max(obs.desired, needed), obs)
        if wanted > obs.desired:
            what = f"every slot busy ({occupied / count:.0%})" if panic else f"{mean:.0%}"
            why = f"utilisation {what} above {policy.high:.0%}: {needed} replicas needed"
            return Decision(wanted, replace(seen, low_since=None, changed_at=now), mean, why)
        why = "above the band; " + (
            f"{obs.coming} replica(s) coming" if obs.coming else "at the limit"
        )
        return Decision(obs.desired, replace(seen, low_since=None), mean, why)
    if mean >= policy.low - _EPS:
        return Decision(obs.desired, replace(seen, low_since=None), mean, "within the band")
    needed = max(1, math.ceil(load / policy.target - _EPS))
    if needed >= obs.desired or obs.coming:
        # The window times the condition that removes a replica, not just "below the band".
        why = "below the band, no replica to spare"
        return Decision(obs.desired, replace(seen, low_since=None), mean, why)
    low_since = memory.low_since if memory.low_since is not None else now
    kept = replace(seen, low_since=low_since)
    if now - low_since < policy.down_window_s:
        return Decision(obs.desired, kept, mean, "below the band, within the down window")
    if memory.changed_at is not None and now - memory.changed_at < policy.cooldown_s:
        return Decision(obs.desired, kept, mean, "below the band, cooling down")
    wanted = _bounded(obs.desired - 1, obs)
    if wanted == obs.desired:
        return Decision(obs.desired, kept, mean, "below the band, at the minimum")
    why = f"utilisation {mean:.0%} below {policy.low:.0%} for {now - low_since:.0f} s"
    return Decision(wanted, replace(seen, low_since=None, changed_at=now), mean, why)
