"""How many replicas a deployment should have, pure: the load its edges report in, a replica
count out.

A replica's *utilisation* is the highest of three pressures the edges report for it (the
heartbeat, ``docs/distribution.md``): requests it runs or that wait for it against the
requests it runs at once (``max-num-seqs``), its KV-cache usage, and its token throughput
against what it sustains at full load. The deployment's utilisation is their mean over its
ready replicas. The seeds' rule is to run at 60-70 %, not 100 %: the count that brings the mean
back to the target (65 %) is ``ceil(sum of utilisations / target)``.

* Above the band: scale up at once, straight to that count (a cold start takes minutes,
  so waiting only makes the queue longer), within ``max_replicas`` and the pool's free GPUs;
  replicas already coming (pending, loading, warming) count, so a load that persists while
  they warm does not start more.
* Below the band: scale down one replica at a time, and only once the load has stayed below
  the band for ``down_window_s`` and no change was made for ``cooldown_s``; never while a
  replica is still coming. One replica fewer keeps the mean at or under the target, so a
  scale-down never makes the next pass scale up again (no flapping).
* Inside the band: nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Utilisations this close to a band's edge count as on it (sums of floats are not exact).
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    target: float = 0.65
    low: float = 0.60
    high: float = 0.70
    #: Seconds the load must stay below ``low`` before a replica is removed.
    down_window_s: float = 60.0
    #: Seconds after any change before a replica is removed.
    cooldown_s: float = 120.0


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


def replica_utilisation(load: ReplicaLoad) -> float:
    """The highest of its concurrency, KV-cache and throughput pressure (1.0: saturated;
    above 1 when requests queue)."""
    concurrency = (load.in_flight + load.queued) / max(1, load.max_concurrency)
    throughput = load.tokens_per_s / load.full_tokens_per_s if load.full_tokens_per_s > 0 else 0.0
    return max(concurrency, min(1.0, max(0.0, load.kv_cache_usage)), throughput)


@dataclass(frozen=True, slots=True)
class Memory:
    """What the policy remembers between passes (seconds on one clock, None: never)."""

    #: When the load went below the band (reset as soon as it is not).
    low_since: float | None = None
    #: When the policy last changed the replica count.
    changed_at: float | None = None


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


def autoscale_step(
    obs: DeploymentLoad, memory: Memory, *, now: float, policy: AutoscalePolicy
) -> Decision:
    """The replica count for this pass, what to remember, and why."""
    clamped = _bounded(obs.desired, obs)
    if clamped != obs.desired:  # min or max moved under it
        return Decision(
            clamped, Memory(None, now), None, f"kept within {obs.min_replicas}-{obs.max_replicas}"
        )
    if not obs.ready or obs.unreported:
        # Nothing (or not everything) serving reports yet: its load is unknown, hold still.
        return Decision(obs.desired, Memory(None, memory.changed_at), None, "load not reported")
    total = sum(replica_utilisation(r) for r in obs.ready)
    mean = total / len(obs.ready)
    needed = max(1, math.ceil(total / policy.target - _EPS))
    if mean > policy.high + _EPS:
        wanted = _bounded(max(obs.desired, needed), obs)
        if wanted > obs.desired:
            why = f"utilisation {mean:.0%} above {policy.high:.0%}: {needed} replicas needed"
            return Decision(wanted, Memory(None, now), mean, why)
        why = "above the band; " + (
            f"{obs.coming} replica(s) coming" if obs.coming else "at the limit"
        )
        return Decision(obs.desired, Memory(None, memory.changed_at), mean, why)
    if mean >= policy.low - _EPS:
        return Decision(obs.desired, Memory(None, memory.changed_at), mean, "within the band")
    low_since = memory.low_since if memory.low_since is not None else now
    kept = Memory(low_since, memory.changed_at)
    if needed >= obs.desired or obs.coming:
        return Decision(obs.desired, kept, mean, "below the band, no replica to spare")
    if now - low_since < policy.down_window_s:
        return Decision(obs.desired, kept, mean, "below the band, within the down window")
    if memory.changed_at is not None and now - memory.changed_at < policy.cooldown_s:
        return Decision(obs.desired, kept, mean, "below the band, cooling down")
    wanted = _bounded(obs.desired - 1, obs)
    if wanted == obs.desired:
        return Decision(obs.desired, kept, mean, "below the band, at the minimum")
    why = f"utilisation {mean:.0%} below {policy.low:.0%} for {now - low_since:.0f} s"
    return Decision(wanted, Memory(None, now), mean, why)
