"""The forecaster's reads: per autoscaled deployment, the replicas that the demand expected a
cold start from now (``federation.fleet.forecast``), plus warm spare for the loss of the
largest other region, needs. The autoscaler keeps ``desired_replicas`` at or above it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import F, Min, Sum

from federation.fleet import forecast
from federation.inventory.models import Deployment
from federation.inventory.speed import replica_tokens_per_s
from federation.metering.models import UsageHour


@dataclass(frozen=True, slots=True)
class Floor:
    replicas: int
    #: Tokens/s the deployment's share is sized for: forecast plus warm spare.
    tokens_per_s: float
    spare_tokens_per_s: float


def usage_series(model: str, *, since: datetime, now: datetime) -> dict[str, dict[datetime, float]]:
    """Region -> hour -> mean tokens/s of ``model`` over the complete hours since ``since``."""
    rows = (
        UsageHour.objects.filter(model=model, hour__gte=since, hour__lt=forecast.hour_of(now))
        .values("region", "hour")
        .annotate(tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
    )
    out: dict[str, dict[datetime, float]] = defaultdict(dict)
    for row in rows:
        out[row["region"]][row["hour"]] = row["tokens"] / 3600
    return out


def forecast_floors(
    deployments: Iterable[Deployment],
    *,
    now: datetime,
    policy: forecast.ForecastPolicy,
    target: float,
) -> dict[int, Floor]:
    """Deployment pk -> its floor. A region's forecast plus spare is split evenly over the
    model's autoscaled deployments there."""
    by_model: dict[str, dict[str, list[Deployment]]] = defaultdict(lambda: defaultdict(list))
    for dep in deployments:
        by_model[dep.model.name][dep.pool.region.code].append(dep)
    floors: dict[int, Floor] = {}
    for model, regions in by_model.items():
        first = UsageHour.objects.filter(model=model).aggregate(first=Min("hour"))["first"]
        if first is None:
            continue
        since = max(first, forecast.hour_of(now) - timedelta(days=policy.days))
        series = usage_series(model, since=since, now=now)
        expected = {
            region: forecast.preload_forecast(
                series.get(region, {}), now=now, since=since, policy=policy
            )
            for region in regions
        }
        extra = forecast.spare(expected)
        for region, deps in regions.items():
            share = (expected[region] + extra[region]) / len(deps)
            for dep in deps:
                cap = replica_tokens_per_s(
                    relative_speed=dep.pool.accelerator.relative_speed,
                    tensor_parallel_size=dep.tensor_parallel_size,
                    params_b=float(dep.model.parameter_count_b),
                )
                floors[dep.pk] = Floor(
                    forecast.replicas_for(share, replica_tokens_per_s=cap, target=target),
                    share,
                    extra[region] / len(deps),
                )
    return floors
