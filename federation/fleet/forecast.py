"""Demand expected per model and region, from hourly usage: pure, no Django.

Traffic follows the clock (people work by day), so the hour ahead is best predicted by the
same hour of the previous days, scaled by how today compares with them:

* *seasonal* ``S(h)``: the mean of hour ``h``'s tokens/s over the last ``days`` days (an hour
  without usage counts as zero once the history covers it);
* *level*: the last ``recent_hours`` hours' actual mean over their seasonal mean (a busier
  day than usual scales the profile up), within ``1 / max_level_ratio .. max_level_ratio``;
* the forecast for an instant is ``S(hour) x level``; without history of that hour, the recent
  mean.

Preloading: a replica takes ``lead_time_s`` to be ready, so the floor is the larger of the
forecast for now and for ``now + lead_time_s`` — instances start before the traffic comes.
Warm spare: every region keeps extra capacity so that, if the largest *other* region is lost,
the survivors absorb its demand between them in proportion to their own (``spare``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

HOUR = timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class ForecastPolicy:
    days: int = 7
    recent_hours: int = 3
    #: A cold start (weights loaded, engine warmed) plus the routing tables' propagation.
    lead_time_s: float = 900.0
    max_level_ratio: float = 3.0


def hour_of(at: datetime) -> datetime:
    return at.replace(minute=0, second=0, microsecond=0)


def seasonal(
    series: Mapping[datetime, float], hour: datetime, *, since: datetime, days: int
) -> float | None:
    """Mean tokens/s of ``hour``'s time of day over the last ``days`` days that the history
    (starting at ``since``) covers; None when it covers none."""
    seen = [
        series.get(hour - timedelta(days=k), 0.0)
        for k in range(1, days + 1)
        if hour - timedelta(days=k) >= since
    ]
    return sum(seen) / len(seen) if seen else None


def forecast_at(
    series: Mapping[datetime, float],
    at: datetime,
    *,
    now: datetime,
    since: datetime,
    policy: ForecastPolicy,
) -> float:
    """Tokens/s expected at ``at`` from the hourly ``series`` (hour start -> mean tokens/s)
    known at ``now`` (complete hours before ``hour_of(now)``), history from ``since``."""
    current = hour_of(now)
    recent = [
        current - HOUR * i for i in range(1, policy.recent_hours + 1) if current - HOUR * i >= since
    ]
    actual = sum(series.get(h, 0.0) for h in recent) / len(recent) if recent else 0.0
    profile = seasonal(series, hour_of(at), since=since, days=policy.days)
    usual = [
        s for h in recent if (s := seasonal(series, h, since=since, days=policy.days)) is not None
    ]
    if profile is None or not usual:
        return actual
    usual_mean = sum(usual) / len(usual)
    if usual_mean <= 0:
        return max(profile, actual)
    level = min(policy.max_level_ratio, max(1 / policy.max_level_ratio, actual / usual_mean))
    return profile * level


def preload_forecast(
    series: Mapping[datetime, float], *, now: datetime, since: datetime, policy: ForecastPolicy
) -> float:
    """Tokens/s to have capacity for now: the forecast for now and for a cold start ahead."""
    ahead = now + timedelta(seconds=policy.lead_time_s)
    return max(
        forecast_at(series, now, now=now, since=since, policy=policy),
        forecast_at(series, ahead, now=now, since=since, policy=policy),
    )


def spare(forecasts: Mapping[str, float]) -> dict[str, float]:
    """Extra tokens/s per region so that the loss of any one other region is absorbed: region
    ``r`` takes its share (by its own forecast; evenly when the others have none) of the
    largest demand among the other regions it may lose."""
    out: dict[str, float] = {}
    for r in forecasts:
        extra = 0.0
        for q, lost in forecasts.items():
            if q == r or lost <= 0:
                continue
            others = {s: f for s, f in forecasts.items() if s != q}
            total = sum(others.values())
            share = forecasts[r] / total if total > 0 else 1 / len(others)
            extra = max(extra, lost * share)
        out[r] = extra
    return out


def replicas_for(tokens_per_s: float, *, replica_tokens_per_s: float, target: float) -> int:
    """Replicas that carry ``tokens_per_s`` at the target utilisation."""
    if tokens_per_s <= 0:
        return 0
    return math.ceil(tokens_per_s / (target * replica_tokens_per_s) - 1e-9)
