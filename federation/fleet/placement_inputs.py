"""Reads of the placement planner: the fleet as ``federation.fleet.placement`` sees it, built
from the database, and the fingerprint that tells whether it changed since a plan.

What the planner manages: the mixed (prefill and decode) deployments on pools whose engines
the worker starts (local, kubernetes) in regions that are not evacuated. Prefill-only and
decode-only deployments on those pools keep their nodes (``reserved_gpus``); deployments on
static pools are the operator's and count as fixed capacity of their region.

Demand, tokens per second per (residency class, region, model), comes from the usage rollups
of the last ``window_hours`` (``UsageHour``, per tenant: each tenant's tokens are placed only
where its residency allows) when there are any; otherwise from the edges' heartbeats (the
tokens/s each ready instance served, as fresh as the autoscaler reads them), which name no
tenant, so that demand may be served only in the region that saw it.

Demand may go from its region only where a region link leads (as in the routing tables: an
edge spills only to the regions it reaches), priced by the link's RTT.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F, Sum

from federation.fleet import placement_types, selectors
from federation.inventory import lifecycle
from federation.inventory.models import (
    Deployment,
    GPUPool,
    Instance,
    LanguageModel,
    Region,
    RegionLink,
)
from federation.inventory.services.fit_checks import model_spec, pool_spec
from federation.inventory.speed import replica_tokens_per_s
from federation.metering.models import UsageHour
from federation.routing.selectors import tenant_rows
from federation.tenancy.residency import RegionRef, region_allowed

MIXED = Deployment.Role.MIXED


@dataclass(frozen=True, slots=True)
class DemandOverride:
    """Demand an operator states instead of the measured one ("what if")."""

    model: str
    region: str
    tokens_per_s: float
    #: The tenant it belongs to (its residency class); empty: only ``region`` may serve it.
    tenant: str = ""


def local_class(region: str) -> str:
    return f"region:{region}"


def managed_pools() -> list[GPUPool]:
    return list(
        GPUPool.objects.exclude(provisioner=GPUPool.Provisioner.STATIC)
        .exclude(region__status=Region.Status.EVACUATED)
        .select_related("region", "accelerator")
        .order_by("pk")
    )


def pool_key(pool: GPUPool) -> str:
    return f"{pool.region.code}/{pool.name}"


def managed_deployments(pools: Iterable[GPUPool]) -> list[Deployment]:
    return list(
        Deployment.objects.filter(pool__in=list(pools), role=MIXED)
        .select_related("model", "pool__region", "pool__accelerator")
        .order_by("pk")
    )


def fleet_fingerprint() -> str:
    """SHA-256 of what a plan depends on: every deployment's placement and counts, every
    pool's size and status and its region's status."""
    deps = Deployment.objects.order_by("pk").values_list(
        "pk",
        "model_id",
        "pool_id",
        "role",
        "tensor_parallel_size",
        "min_replicas",
        "desired_replicas",
        "max_replicas",
    )
    pools = GPUPool.objects.order_by("pk").values_list(
        "pk", "node_count", "gpus_per_node", "status", "provisioner", "region__status"
    )
    blob = json.dumps([list(deps), list(pools)], default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _classes(regions: list[RegionRef]) -> tuple[dict[str, frozenset[str]], dict[str, str]]:
    """Residency classes (tenants grouped by the regions they allow) and each tenant's."""
    classes = {local_class(r.code): frozenset({r.code}) for r in regions}
    of_tenant: dict[str, str] = {}
    for row in tenant_rows(keys_and_budgets=False):
        allowed = frozenset(
            r.code for r in regions if region_allowed(row.policy, r.code, r.jurisdiction)
        )
        name = "regions:" + ",".join(sorted(allowed))
        classes[name] = allowed
        of_tenant[row.slug] = name
    return classes, of_tenant


def measured_demand(
    *, now: datetime, window_hours: int, of_tenant: dict[str, str]
) -> list[placement_types.Demand]:
    """Tokens/s per (class, region, model): the usage rollups, else the heartbeats."""
    since = now - timedelta(hours=window_hours)
    rows = (
        UsageHour.objects.filter(hour__gte=since, hour__lt=now)
        .values("tenant", "region", "model")
        .annotate(tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
    )
    seconds = window_hours * 3600
    sums: dict[tuple[str, str, str], float] = defaultdict(float)
    for row in rows:
        cls = of_tenant.get(row["tenant"], local_class(row["region"]))
        sums[(cls, row["region"], row["model"])] += row["tokens"] / seconds
    if not sums:
        fresh_s = settings.FEDINFER_FLEET_REPORT_FRESH_SECONDS
        ready = Instance.objects.filter(state=lifecycle.READY, deployment__role=MIXED)
        for inst in ready.select_related("deployment__model", "deployment__pool__region"):
            seen = selectors.instance_load(inst, now, fresh_s)
            if seen is not None and seen[3] > 0:
                region = inst.deployment.pool.region.code
                sums[(local_class(region), region, inst.deployment.model.name)] += seen[3]
    return [placement_types.Demand(c, r, m, t) for (c, r, m), t in sorted(sums.items()) if t > 0]


def placement_input(
    *,
    now: datetime,
    window_hours: int = 3,
    override: Iterable[DemandOverride] | None = None,
    target: float = placement_types.TARGET_UTILISATION,
) -> placement_types.PlacementInput:
    """The planner's input read from the database (``override``: the demand to plan for
    instead of the measured one)."""
    regions = [RegionRef(r.code, r.jurisdiction) for r in Region.objects.order_by("code")]
    classes, of_tenant = _classes(regions)
    pools = managed_pools()
    offers: list[placement_types.PoolOffer] = []
    reserved: dict[int, int] = defaultdict(int)
    for dep in Deployment.objects.filter(pool__in=pools).exclude(role=MIXED):
        reserved[dep.pool_id] += dep.tensor_parallel_size * dep.desired_replicas
    for pool in pools:
        offers.append(
            placement_types.PoolOffer(
                key=pool_key(pool),
                region=pool.region.code,
                spec=pool_spec(pool),
                relative_speed=pool.accelerator.relative_speed,
                price_per_gpu_hour=float(pool.price_per_gpu_hour),
                capacity_type=pool.capacity_type,
                reserved_gpus=reserved[pool.pk],
                accepts_new=pool.status == GPUPool.Status.ACTIVE
                and pool.region.status == Region.Status.ACTIVE,
            )
        )
    models = [
        placement_types.PlannedModel(m.name, model_spec(m), float(m.parameter_count_b))
        for m in LanguageModel.objects.order_by("name")
    ]
    current = [
        placement_types.Current(
            d.model.name,
            pool_key(d.pool),
            d.tensor_parallel_size,
            d.desired_replicas,
            d.min_replicas,
        )
        for d in managed_deployments(pools)
    ]
    if override is None:
        demand = measured_demand(now=now, window_hours=window_hours, of_tenant=of_tenant)
    else:
        demand = [
            placement_types.Demand(
                of_tenant.get(o.tenant, local_class(o.region))
                if o.tenant
                else local_class(o.region),
                o.region,
                o.model,
                o.tokens_per_s,
            )
            for o in override
        ]
    rtt = {
        (link.source.code, link.target.code): (
            link.measured_rtt_ms if link.measured_rtt_ms is not None else link.rtt_ms
        )
        for link in RegionLink.objects.select_related("source", "target")
    }
    return placement_types.PlacementInput(
        rtt_ms=rtt,
        pools=offers,
        models=models,
        demand=demand,
        classes=classes,
        current=current,
        fixed_capacity=_static_capacity(target),
    )


def _static_capacity(target: float) -> dict[tuple[str, str], float]:
    """Tokens/s at the target that static pools' mixed deployments serve, per region and
    model (their engines are the operator's; the planner only counts on them)."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    static = Deployment.objects.filter(
        pool__provisioner=GPUPool.Provisioner.STATIC, role=MIXED
    ).exclude(pool__region__status=Region.Status.EVACUATED)
    for d in static.select_related("model", "pool__region", "pool__accelerator"):
        cap = replica_tokens_per_s(
            relative_speed=d.pool.accelerator.relative_speed,
            tensor_parallel_size=d.tensor_parallel_size,
            params_b=float(d.model.parameter_count_b),
        )
        out[(d.pool.region.code, d.model.name)] += target * cap * d.desired_replicas
    return dict(out)
