"""The forecaster (federation/fleet/forecast.py) on a synthetic week of hourly usage."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from federation.fleet.forecast import (
    ForecastPolicy,
    forecast_at,
    preload_forecast,
    replicas_for,
    spare,
)

START = datetime(2026, 11, 20, tzinfo=UTC)


def day_curve(hour: int) -> float:
    """Tokens/s of a working day: 200 at night, 5,000 at 14:00."""
    return 200 + 4800 * max(0.0, math.sin(math.pi * (hour - 6) / 16)) if 6 <= hour <= 22 else 200


def week(scale: float = 1.0, days: int = 7) -> dict[datetime, float]:
    return {START + timedelta(hours=h): day_curve(h % 24) * scale for h in range(days * 24)}


NOW = START + timedelta(days=7, hours=8, minutes=30)  # 08:30 on the eighth day


def test_same_hour_of_previous_days_predicts_the_morning_ramp() -> None:
    series = week()
    for h in range(7 * 24, 7 * 24 + 8):  # today so far, as usual
        series[START + timedelta(hours=h)] = day_curve(h % 24)
    policy = ForecastPolicy()
    at_nine = forecast_at(series, NOW + timedelta(minutes=30), now=NOW, since=START, policy=policy)
    assert math.isclose(at_nine, day_curve(9), rel_tol=1e-6)
    # the preload looks a cold start ahead: at 08:30 with 45 min lead it plans for 09:00+
    ahead = preload_forecast(series, now=NOW, since=START, policy=ForecastPolicy(lead_time_s=2700))
    assert ahead == max(day_curve(8), day_curve(9)) > day_curve(8)


def test_a_busier_day_scales_the_profile() -> None:
    series = week()
    for h in range(7 * 24, 7 * 24 + 8):
        series[START + timedelta(hours=h)] = 2 * day_curve(h % 24)
    f = forecast_at(series, NOW, now=NOW, since=START, policy=ForecastPolicy())
    assert math.isclose(f, 2 * day_curve(8), rel_tol=1e-6)


def test_without_history_the_recent_mean_is_the_forecast() -> None:
    since = NOW - timedelta(hours=3, minutes=30)  # 05:00: three complete hours before 08:00
    series = {since + timedelta(hours=i): 900.0 for i in range(3)}
    assert forecast_at(series, NOW, now=NOW, since=since, policy=ForecastPolicy()) == 900.0


def test_spare_absorbs_the_loss_of_the_largest_other_region() -> None:
    forecasts = {"us": 6000.0, "eu": 3000.0, "ap": 1000.0}
    extra = spare(forecasts)
    for lost, tokens in forecasts.items():
        survivors = [r for r in forecasts if r != lost]
        assert sum(extra[r] for r in survivors) >= tokens - 1e-6
    assert math.isclose(extra["us"], 3000.0 * 6000 / 7000)  # the largest other for us: eu
    assert spare({"us": 100.0, "eu": 0.0}) == {"us": 0.0, "eu": 100.0}


def test_replicas_for_the_target() -> None:
    assert replicas_for(0, replica_tokens_per_s=1000, target=0.65) == 0
    assert replicas_for(650, replica_tokens_per_s=1000, target=0.65) == 1
    assert replicas_for(651, replica_tokens_per_s=1000, target=0.65) == 2
