"""Warm preloading through the autoscaler, on real PostgreSQL: a synthetic week of hourly
usage rows, the autoscale pass at 08:30, and the forecast floor under desired_replicas (with
warm spare for the loss of the largest other region), audited."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from decimal import Decimal
from unittest import mock

import pytest

from federation.core.models import AuditEvent
from federation.fleet import autoscaling, forecast
from federation.inventory.models import Deployment
from federation.inventory.speed import replica_tokens_per_s
from federation.metering.models import UsageHour
from tests.integration.inventory_factories import (
    LLAMA_8B,
    make_deployment,
    make_model,
    make_pool,
    make_region,
)

LLAMA = LLAMA_8B["name"]
CONFIG = autoscaling.AutoscaleConfig(preload=forecast.ForecastPolicy(lead_time_s=1800))


def day_curve(hour: int) -> float:
    """Tokens/s of a working day: 500 at night, 20,000 at 14:00."""
    return 500 + 19_500 * max(0.0, math.sin(math.pi * (hour - 6) / 16)) if 6 <= hour <= 22 else 500


def usage(region: str, start: datetime, hours: int, scale: float) -> None:
    UsageHour.objects.bulk_create(
        UsageHour(
            hour=start + timedelta(hours=h),
            tenant="acme",
            model=LLAMA,
            region=region,
            pool=f"{region}/h100",
            requests=1,
            cancelled=0,
            errors=0,
            prompt_tokens=int(day_curve((start + timedelta(hours=h)).hour) * scale * 3600),
            cached_tokens=0,
            completion_tokens=0,
            price_usd=Decimal(0),
            cost_usd=Decimal(0),
        )
        for h in range(hours)
    )


@pytest.fixture
def deployments(db: None) -> dict[str, Deployment]:
    model = make_model()
    out = {}
    for code, jurisdiction in (("us-east", "US"), ("eu-west", "EU")):
        pool = make_pool(make_region(code, jurisdiction), provisioner="local", node_count=4)
        out[code] = make_deployment(
            model, pool, min_replicas=1, desired_replicas=1, max_replicas=20, autoscale=True
        )
    return out


def test_the_forecast_starts_replicas_ahead_of_the_morning_and_keeps_warm_spare(
    deployments: dict[str, Deployment],
) -> None:
    start = datetime.fromisoformat("2026-11-20T00:00:00+00:00")
    now = start + timedelta(days=7, hours=8, minutes=30)
    usage("us-east", start, 7 * 24 + 8, 1.0)  # a week and today until 08:00, as usual
    usage("eu-west", start, 7 * 24 + 8, 0.25)
    with mock.patch("django.utils.timezone.now", return_value=now):
        lines = autoscaling.fleet_autoscale(config=CONFIG)
    cap = replica_tokens_per_s(relative_speed=1.0, tensor_parallel_size=1, params_b=8.03)
    # 08:30 + 30 min lead: the 09:00 level, not the 08:00 one
    us, eu = day_curve(9), 0.25 * day_curve(9)
    expected = {
        "us-east": math.ceil((us + eu) / (0.65 * cap)),  # absorbs all of eu's if eu is lost
        "eu-west": math.ceil((eu + us) / (0.65 * cap)),  # and eu all of us's
    }
    got = {
        code: Deployment.objects.get(pk=d.pk).desired_replicas for code, d in deployments.items()
    }
    assert got == expected, lines
    assert got["us-east"] > math.ceil(day_curve(8) / (0.65 * cap))  # ahead of the traffic
    events = AuditEvent.objects.filter(action="fleet.autoscale")
    assert events.count() == 2
    assert all("forecast floor" in e.changes["reason"] for e in events)
    # a second pass changes nothing: the floor holds, the policy does not scale it down
    with mock.patch("django.utils.timezone.now", return_value=now + timedelta(minutes=1)):
        assert autoscaling.fleet_autoscale(config=CONFIG) == []


def test_without_usage_there_is_no_floor(deployments: dict[str, Deployment]) -> None:
    assert autoscaling.fleet_autoscale(config=CONFIG) == []
    assert {d.desired_replicas for d in Deployment.objects.all()} == {1}
