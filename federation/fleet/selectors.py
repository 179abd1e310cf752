"""Reads of the fleet's worker: which deployments it provisions, what it hands a provisioner,
and what edge heartbeats say about instances and regions."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import QuerySet

from federation.fleet.spec import Adapter, EngineSpec, ProvisionerError
from federation.inventory import fit, lifecycle
from federation.inventory.models import Deployment, Edge, GPUPool, Instance, Region
from federation.inventory.services.fit_checks import pool_spec
from federation.routing.models import RoutingTableVersion


def provisioned_deployments() -> QuerySet[Deployment]:
    """Deployments on pools whose engines the worker starts (not static ones)."""
    return (
        Deployment.objects.exclude(pool__provisioner=GPUPool.Provisioner.STATIC)
        .select_related("model", "pool__region", "pool__accelerator")
        .prefetch_related("adapters")
        .order_by("pk")
    )


def autoscaled_deployments() -> QuerySet[Deployment]:
    """Provisioned deployments whose replica count the autoscaler sets."""
    return provisioned_deployments().filter(autoscale=True)


def cold_demand(deployment: Deployment, now: datetime, fresh_s: float) -> int:
    """Requests the region's edges hold or refused for the deployment's model while it has no
    ready instance (their fresh heartbeats' ``cold``), when this deployment is the one to wake:
    the first (by id) of the model's deployments at zero in the region, and only while none of
    them wants a replica — one request wakes one replica, not one per pool."""
    model, region = deployment.model_id, deployment.pool.region_id
    siblings = Deployment.objects.filter(
        model_id=model, pool__region_id=region, role=deployment.role
    ).values_list("pk", "desired_replicas")
    at_zero = sorted(pk for pk, desired in siblings if desired == 0)
    if any(desired > 0 for _, desired in siblings) or not at_zero or at_zero[0] != deployment.pk:
        return 0
    name = deployment.model.name
    since = now - timedelta(seconds=fresh_s)
    total = 0
    for report in Edge.objects.filter(region_id=region, last_heartbeat_at__gte=since).values_list(
        "cold_demand", flat=True
    ):
        entry = report.get(name) if isinstance(report, dict) else None
        if not isinstance(entry, dict):
            continue
        try:
            at = datetime.fromisoformat(entry["reported_at"])
            if at < since:
                continue
            total += int(entry.get("held", 0)) + int(entry.get("arrived", 0))
        except (KeyError, TypeError, ValueError):
            continue
    return total


def pool_free_gpus(pool: GPUPool) -> int:
    """GPUs of the pool no deployment claims (desired replicas x TP)."""
    demands = Deployment.objects.filter(pool=pool).values_list(
        "tensor_parallel_size", "desired_replicas"
    )
    return fit.pool_free_gpus(pool_spec(pool), demands)


def deployment_instances(deployment: Deployment) -> list[Instance]:
    return list(
        Instance.objects.filter(deployment=deployment)
        .select_related("runtime")
        .order_by("created_at", "pk")
    )


def engine_spec(deployment: Deployment, *, name: str, url: str) -> EngineSpec:
    """What to run for one replica of ``deployment`` (loaded by :func:`provisioned_deployments`)."""
    args: dict[str, Any] = dict(deployment.engine_args or {})
    max_model_len = args.pop("max-model-len", None)
    if max_model_len is not None and not isinstance(max_model_len, int):
        raise ProvisionerError(f"engine_args max-model-len must be an integer: {max_model_len!r}")
    return EngineSpec(
        name=name,
        url=url,
        model=deployment.model.name,
        served_model_name=deployment.model.name,
        tensor_parallel_size=deployment.tensor_parallel_size,
        gpu_memory_utilization=deployment.pool.gpu_memory_utilization,
        max_model_len=max_model_len,
        gpus_per_node=deployment.pool.gpus_per_node,
        accelerator=deployment.pool.accelerator.name,
        role=deployment.role,
        adapters=tuple(
            Adapter(name=a.name, source=a.source, rank=a.rank)
            for a in sorted(deployment.adapters.all(), key=lambda a: a.name)
        ),
        engine_args=args,
    )


def _fresh_reports(load: Any, since: datetime, now: datetime, fresh_s: float) -> list[dict]:
    """The per-edge reports of a load snapshot made after ``since`` and within ``fresh_s``."""
    edges = load.get("edges") if isinstance(load, dict) else None
    if not isinstance(edges, dict):
        return []
    out = []
    for report in edges.values():
        try:
            at = datetime.fromisoformat(report["reported_at"])
        except (TypeError, KeyError, ValueError):
            continue
        if at >= since and (now - at).total_seconds() <= fresh_s:
            out.append(report)
    return out


def edge_view(instance: Instance, now: datetime, fresh_s: float) -> tuple[bool, int | None]:
    """(every fresh edge report calls it unhealthy, requests in flight summed over them); only
    reports made since its last state change count (an edge's opinion of it before it became
    ready says nothing about it now)."""
    since = instance.state_changed_at or instance.created_at
    reports = _fresh_reports(instance.load, since, now, fresh_s)
    if not reports:
        return False, None
    unhealthy = all(r.get("healthy") is False for r in reports)
    in_flight = sum(int(r.get("in_flight") or 0) for r in reports)
    return unhealthy, in_flight


def instance_load(
    instance: Instance, now: datetime, fresh_s: float
) -> tuple[int, int, float, float, int] | None:
    """(in flight, queued, KV-cache usage, tokens/s, overflow) the fresh edge reports made since the
    instance's last state change say of it, summed over the edges (KV: the highest, each edge
    scrapes the same engine); None when no edge reported on it."""
    since = instance.state_changed_at or instance.created_at
    reports = _fresh_reports(instance.load, since, now, fresh_s)
    if not reports:
        return None
    return (
        int(sum(_number(r.get("in_flight")) for r in reports)),
        int(sum(_number(r.get("queued")) for r in reports)),
        max(_number(r.get("kv_cache_usage")) for r in reports),
        sum(_number(r.get("tokens_per_s")) for r in reports),
        int(sum(_number(r.get("overflow")) for r in reports)),
    )


def _number(value: Any) -> float:
    """A report's count or rate, 0 when absent (reports are validated on arrival; an older
    edge may leave a field out)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def edges_caught_up(instance: Instance, now: datetime, fresh_s: float) -> bool:
    """Whether every edge of the instance's region that is alive (heard within ``fresh_s``)
    has applied a table published since the instance's last state change that no longer lists
    it: from then on no edge sends it anything new. Tables are numbered in the order their
    fleet was read, so once one version lacks it every later one does too, unless its state
    changes again."""
    region_id = instance.deployment.pool.region_id
    since = instance.state_changed_at or instance.created_at
    without: int | None = None
    for version, document in (
        RoutingTableVersion.objects.filter(region_id=region_id, created_at__gte=since)
        .order_by("version")
        .values_list("version", "document")
    ):
        listed = {i.get("id") for i in document.get("instances", []) if isinstance(i, dict)}
        if instance.name in listed:
            without = None
        elif without is None:
            without = version
    if without is None:
        return False
    behind = Edge.objects.filter(
        region_id=region_id,
        last_heartbeat_at__gte=now - timedelta(seconds=fresh_s),
    ).exclude(applied_table_version__gte=without)
    return not behind.exists()


def region_edge_silence(region: Region, now: datetime) -> list[float]:
    """Seconds since each edge of the region last sent a heartbeat (edges that never did are
    not counted: a region that never had a working edge is not 'fallen silent')."""
    heard = Edge.objects.filter(region=region, last_heartbeat_at__isnull=False).values_list(
        "last_heartbeat_at", flat=True
    )
    return [(now - at).total_seconds() for at in heard if at is not None]


def region_instance_counts(region: Region, now: datetime, window_s: float) -> tuple[int, int]:
    """(instances failed within ``window_s``, instances ready or drained by an evacuation)."""
    instances = Instance.objects.filter(deployment__pool__region=region)
    failed = instances.filter(
        state=lifecycle.FAILED, state_changed_at__gte=now - timedelta(seconds=window_s)
    ).count()
    serving = (
        instances.filter(state=lifecycle.READY).count()
        + instances.filter(
            state=lifecycle.DRAINING, drain_reason=Instance.DrainReason.EVACUATION
        ).count()
    )
    return failed, serving
