"""How far the long operations have got, from what the control plane already knows: a
loading or warming instance's time against the timeout the fleet worker fails it at, a
draining instance's requests still in flight (from the edges' fresh heartbeats) and, when the
worker stops it at a timeout, its time against that, and a returning region's ramp against its
schedule (the compiler's steps). Pure: no queries, no settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from federation.inventory import lifecycle
from federation.routing.compiler import EVACUATED
from federation.routing.ramp import ramp_level, ramp_next_change_s
from federation.routing.selectors import LOAD_REPORT_MAX_AGE_S
from federation.routing.snapshot import RampPolicy

#: ``Instance.DrainReason`` of a drain the fleet worker started (and stops at its timeout).
SCALE_DOWN = "scale_down"


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds the fleet worker lets an instance stay loading, warming or draining after a
    scale-down (``FEDINFER_FLEET_*_TIMEOUT_SECONDS``)."""

    loading_s: float
    warming_s: float
    drain_s: float


@dataclass(frozen=True, slots=True)
class Progress:
    """What an operation has done: ``value`` of ``maximum`` for a progress bar (no bar when
    the end is not known), and the sentence that says it."""

    text: str
    value: float | None = None
    maximum: float | None = None

    @property
    def share(self) -> float | None:
        if self.value is None or not self.maximum:
            return None
        return min(1.0, max(0.0, self.value / self.maximum))


def _seconds(value: float) -> str:
    value = max(0, round(value))
    return f"{value // 60} min {value % 60:02d} s" if value >= 60 else f"{value} s"


def fresh_in_flight(load: Any, now: datetime) -> int | None:
    """Requests in flight on an instance as its edges' heartbeats reported them, while the
    report is fresh; None when unknown or stale."""
    if not isinstance(load, dict):
        return None
    value = load.get("in_flight")
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    try:
        age = (now - datetime.fromisoformat(load["reported_at"])).total_seconds()
    except (TypeError, KeyError, ValueError):
        return None
    return int(value) if age <= LOAD_REPORT_MAX_AGE_S else None


def instance_progress(
    *,
    state: str,
    since: datetime | None,
    drain_reason: str,
    in_flight: int | None,
    now: datetime,
    timeouts: Timeouts,
) -> Progress | None:
    """Progress of an instance's long state (None in the others). ``in_flight``: from
    :func:`fresh_in_flight`."""
    elapsed = (now - since).total_seconds() if since is not None else None
    if state in (lifecycle.LOADING, lifecycle.WARMING):
        limit = timeouts.loading_s if state == lifecycle.LOADING else timeouts.warming_s
        if elapsed is None:
            return Progress(f"{state}; failed if still {state} after {_seconds(limit)}")
        return Progress(
            f"{state} for {_seconds(elapsed)} of the {_seconds(limit)} allowed",
            min(elapsed, limit),
            limit,
        )
    if state != lifecycle.DRAINING:
        return None
    if in_flight is None:
        left = "requests in flight unknown (no fresh heartbeat)"
    elif in_flight == 0:
        left = "drained: nothing in flight"
    else:
        left = f"{in_flight} request{'s' if in_flight != 1 else ''} in flight to finish"
    if drain_reason == SCALE_DOWN and elapsed is not None:
        stop = f"stopped when idle, or after {_seconds(timeouts.drain_s)}"
        return Progress(
            f"{left}; {stop} ({_seconds(elapsed)} so far)",
            min(elapsed, timeouts.drain_s),
            timeouts.drain_s,
        )
    return Progress(left, 1.0 if in_flight == 0 else None, 1.0 if in_flight == 0 else None)


def ramp_progress(
    *,
    status: str,
    restored_at: datetime | None,
    recovered_at: datetime | None,
    now: datetime,
    policy: RampPolicy,
) -> Progress | None:
    """A returning region's ramp (the compiler's steps from the later of its restore and its
    recovery); None when it is not ramping."""
    starts = [t for t in (restored_at, recovered_at) if t is not None]
    if status == EVACUATED or not starts:
        return None
    elapsed = (now - max(starts)).total_seconds()
    level = ramp_level(elapsed, policy)
    if level >= 1.0:
        return None
    step = round(level * (policy.steps + 1))  # levels are 1/(steps+1), 2/(steps+1), ...
    text = f"ramping back: {level * 100:.0f} % of its traffic, step {step} of {policy.steps}"
    following = ramp_next_change_s(elapsed, policy)
    if following is not None:
        text += f", next step in {_seconds(following)}"
    text += f"; all of it in {_seconds(policy.window_s - elapsed)}"
    return Progress(text, elapsed, policy.window_s)
