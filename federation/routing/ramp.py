"""How a region coming back gets its traffic back: in steps, not all at once. Pure.

A region restored after an evacuation, or whose instances are healthy again after all were
lost, gets a share that rises in steps over :class:`RampPolicy`'s window; the tables carry it
(``ramp``, schema 2) so that edges shift traffic back in proportion (docs/edge-federation.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime

from federation.routing.snapshot import RampPolicy, RegionRow


def ramp_level(elapsed_s: float, policy: RampPolicy) -> float:
    """Share of its traffic a region gets ``elapsed_s`` after it came back: the step it is on,
    then 1 once the window has passed."""
    if policy.steps < 1 or elapsed_s >= policy.window_s:
        return 1.0
    step = math.floor(max(elapsed_s, 0.0) * policy.steps / policy.window_s)
    return (step + 1) / (policy.steps + 1)


def ramp_next_change_s(elapsed_s: float, policy: RampPolicy) -> float | None:
    """Seconds until :func:`ramp_level` moves to its next step (None: the ramp is over)."""
    if policy.steps < 1 or elapsed_s >= policy.window_s:
        return None
    step_s = policy.window_s / policy.steps
    elapsed_s = max(elapsed_s, 0.0)
    return (math.floor(elapsed_s / step_s) + 1) * step_s - elapsed_s


def region_down(health: Iterable[bool | None]) -> bool:
    """All of a region's routable instances are reported unhealthy (at least one, and none
    healthy or unknown): it lost its instances, and takes no traffic until they come back."""
    known = list(health)
    return bool(known) and all(h is False for h in known)


def region_ramp(
    region: RegionRow,
    health: Iterable[bool | None],
    *,
    now: datetime | None,
    policy: RampPolicy,
) -> tuple[float, float | None]:
    """(share of its traffic the region gets now, seconds until that changes).

    0 while it is down (:func:`region_down`); stepping up from the later of its restore and its
    recovery; 1 otherwise. Being evacuated or losing all instances again during the window
    moves that start, so the ramp begins again from its first step: no flapping.
    """
    if region_down(health):
        return 0.0, None  # the heartbeat that reports it back recompiles
    starts = [t for t in (region.restored_at, region.recovered_at) if t is not None]
    if now is None or not starts:
        return 1.0, None
    elapsed = (now - max(starts)).total_seconds()
    return ramp_level(elapsed, policy), ramp_next_change_s(elapsed, policy)
