"""The fleet's state as Prometheus gauges, read at scrape time (``federation.core.metrics``).

Routing sits above inventory, tenancy and metering, so it is the one domain that may read
all that these gauges describe: table versions and the edges running them, heartbeat ages,
instance states, the demand the split could not place, tenants' budgets and the usage
stream's backlog. :func:`fleet_gauges` reads (a fixed number of queries and one Redis
command); :class:`FleetCollector` turns the result into metric families.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import redis
from django.db.models import Count
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from federation.inventory import lifecycle
from federation.inventory.models import Instance
from federation.metering.selectors import tenant_month_spend
from federation.routing.distribution import routing_table_overview
from federation.routing.models import RoutingTableVersion
from federation.routing.services import redis_client
from federation.tenancy.models import Tenant
from regions.tables.usage import USAGE_STREAM

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EdgeGauge:
    edge: str
    region: str
    #: Published versions the edge has not applied (all of them when it applied none).
    versions_behind: int
    #: Seconds since its last heartbeat; +Inf when it never sent one.
    heartbeat_age_s: float


@dataclass(slots=True)
class FleetGauges:
    table_version: dict[str, int] = field(default_factory=dict)
    edges: list[EdgeGauge] = field(default_factory=list)
    #: (region, state) -> instances; every state of every region, zeros included.
    instances: dict[tuple[str, str], int] = field(default_factory=dict)
    #: model -> tokens/s the latest tables could not place, summed over origin regions.
    unserved_tokens_per_s: dict[str, float] = field(default_factory=dict)
    #: tenant -> spend this month / monthly budget (tenants with a budget only).
    budget_used_ratio: dict[str, float] = field(default_factory=dict)
    #: Age of the oldest usage-stream entry not yet ingested; None without Redis.
    ingest_lag_s: float | None = None


def usage_ingest_lag_s(client: redis.Redis, now: datetime) -> float:
    """Age of the oldest entry on the usage stream. Ingestion deletes entries once committed,
    so what is left is new or pending: 0 when the stream is empty."""
    oldest: Any = client.xrange(USAGE_STREAM, count=1)
    if not oldest:
        return 0.0
    entry_id = oldest[0][0]
    millis = int(bytes(entry_id).split(b"-")[0])
    return max(0.0, now.timestamp() - millis / 1000.0)


def _unserved(by_region: dict[str, int]) -> dict[str, float]:
    out: dict[str, float] = {}
    latest = RoutingTableVersion.objects.filter(
        region__code__in=list(by_region), version__in=list(by_region.values())
    ).values_list("region__code", "version", "document__routes")
    for code, version, routes in latest:
        if version != by_region[code]:
            continue
        for route in routes or ():
            out[route["model"]] = out.get(route["model"], 0.0) + route["unserved_tokens_per_s"]
    return out


def fleet_gauges(*, now: datetime | None = None) -> FleetGauges:
    """Everything the fleet collector exports, read now."""
    now = now or timezone.now()
    gauges = FleetGauges()
    for region in routing_table_overview():
        latest: int = getattr(region, "latest_version", None) or 0  # annotated
        gauges.table_version[region.code] = latest
        for state in lifecycle.ORDER:
            gauges.instances[(region.code, state)] = 0
        for edge in region.edges.all():
            gauges.edges.append(
                EdgeGauge(
                    edge=edge.name,
                    region=region.code,
                    versions_behind=max(0, latest - (edge.applied_table_version or 0)),
                    heartbeat_age_s=float("inf")
                    if edge.last_heartbeat_at is None
                    else max(0.0, (now - edge.last_heartbeat_at).total_seconds()),
                )
            )
    counts = Instance.objects.values_list("deployment__pool__region__code", "state").annotate(
        n=Count("pk")
    )
    for code, state, n in counts:
        gauges.instances[(code, state)] = n
    gauges.unserved_tokens_per_s = _unserved({c: v for c, v in gauges.table_version.items() if v})
    budgets = Tenant.objects.filter(is_active=True, monthly_budget_usd__isnull=False).values_list(
        "slug", "monthly_budget_usd"
    )
    spend = tenant_month_spend(now=now)
    for slug, budget in budgets:
        spent = float(spend.get(slug, 0))
        gauges.budget_used_ratio[slug] = spent / float(budget) if budget else float("inf")
    client = redis_client()
    if client is not None:
        try:
            gauges.ingest_lag_s = usage_ingest_lag_s(client, now)
        except redis.RedisError as exc:
            log.warning("usage ingest lag not exported (Redis unavailable): %s", exc)
        finally:
            client.close()
    return gauges


class FleetCollector(Collector):
    """Exports :func:`fleet_gauges` on every scrape."""

    def collect(self) -> Iterator[Metric]:
        g = fleet_gauges()
        version = GaugeMetricFamily(
            "fedinfer_cp_table_version",
            "Latest published routing-table version per region (0: none yet)",
            labels=["region"],
        )
        for code, v in g.table_version.items():
            version.add_metric([code], v)
        behind = GaugeMetricFamily(
            "fedinfer_cp_edge_table_versions_behind",
            "Published table versions an edge has not applied yet, from its heartbeats",
            labels=["edge", "region"],
        )
        age = GaugeMetricFamily(
            "fedinfer_cp_edge_heartbeat_age_seconds",
            "Seconds since an edge's last heartbeat (+Inf: never)",
            labels=["edge", "region"],
        )
        for e in g.edges:
            behind.add_metric([e.edge, e.region], e.versions_behind)
            age.add_metric([e.edge, e.region], e.heartbeat_age_s)
        instances = GaugeMetricFamily(
            "fedinfer_cp_instances", "Instances by region and state", labels=["region", "state"]
        )
        for (code, state), n in sorted(g.instances.items()):
            instances.add_metric([code, state], n)
        unserved = GaugeMetricFamily(
            "fedinfer_cp_unserved_demand_tokens_per_second",
            "Demand the latest tables' split could not place anywhere, by model",
            labels=["model"],
        )
        for model, tokens in sorted(g.unserved_tokens_per_s.items()):
            unserved.add_metric([model], tokens)
        budget = GaugeMetricFamily(
            "fedinfer_cp_tenant_budget_used_ratio",
            "A tenant's metered spend this month over its monthly budget (tenants with one)",
            labels=["tenant"],
        )
        for slug, ratio in sorted(g.budget_used_ratio.items()):
            budget.add_metric([slug], ratio)
        yield from (version, behind, age, instances, unserved, budget)
        if g.ingest_lag_s is not None:
            lag = GaugeMetricFamily(
                "fedinfer_cp_usage_ingest_lag_seconds",
                "Age of the oldest usage-stream entry not yet ingested (0: caught up)",
            )
            lag.add_metric([], g.ingest_lag_s)
            yield lag
