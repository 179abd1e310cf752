"""Heartbeats: what edges report, folded into the inventory and the control plane's view.

Each heartbeat records the table version the edge applied, its workers, and per instance its
health and load (merged across the region's edges), its cold-start demand and its budget
spend; a region whose edges all report it unhealthy may start a ramp. The inbound half of
distribution: routing reads what is stored here (instance load, budget reports, cold demand)
when it compiles. Inventory rows are written through inventory's services
(``inventory/services/reports.py``), budget reports through routing's ``budget_report_store``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from federation.core import metrics
from federation.core.errors import Conflict
from federation.inventory import lifecycle
from federation.inventory import services as inventory
from federation.inventory.models import Edge, Instance, Region
from federation.routing.distribution import routing_table_latest_version
from federation.routing.ramp import region_down
from federation.routing.selectors import LOAD_REPORT_MAX_AGE_S, reported_health
from federation.routing.services import budget_report_store, routing_tables_schedule_recompile
from federation.telemetry.wake import cold_demand_store, fleet_wake_schedule
from regions.tables.schema import lease_holder

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InstanceReport:
    """One instance as an edge sees it."""

    id: str
    healthy: bool
    load: dict[str, Any]


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    edge: Edge
    updated_instances: list[str]
    unknown_instances: list[str]


def edge_heartbeat_record(
    *,
    edge: Edge,
    applied_table_version: int | None,
    instances: Sequence[InstanceReport],
    budgets: Mapping[tuple[str, str], int] | None = None,
    cold: Mapping[str, tuple[int, int]] | None = None,
    at: datetime | None = None,
    worker: int = 0,
    workers: int = 1,
) -> HeartbeatResult:
    """Store an edge's heartbeat: its liveness, the table version it applied, what it sees
    of its region's instances and what it committed of the budgets it holds leases of
    (``budgets``: (tenant, key prefix or "") -> pico-USD), in one transaction; ``cold``:
    model -> (requests held now, arrived since the last heartbeat) of models with no ready
    instance, which queues the autoscale pass at once when any has demand (``wake.py``).

    A version lower than the one the edge reported before is refused (``Conflict``), yet the
    edge's liveness is still recorded: it is alive, only confused. Instances the edge names
    that are not in its region are listed back, not refused: its table may predate a delete.

    An edge running several worker processes (``workers``) sends a heartbeat from each, as
    the holder :func:`~regions.tables.schema.lease_holder` names: each worker's instance load
    and cold demand are kept apart and added up, and its budget report is its own (it holds
    leases of its own). Only worker 0 speaks for the edge's table version: the workers sync
    their tables each on its own, so their versions may differ for a moment. ``workers`` is
    a claim, believed up to the edge's configured ``max_workers`` (clamped above it, counted);
    a ``worker`` at or above that bound is refused.
    """
    now = at or timezone.now()
    holder = lease_holder(edge.name, worker)
    worker_in_bound_check(edge, worker)
    if worker > 0:
        return _worker_heartbeat_record(
            edge, holder, workers, applied_table_version, instances, budgets, cold, now
        )
    refusal: Conflict | None = None
    with transaction.atomic():
        _commit_without_flush()
        edge = Edge.objects.select_related("region").select_for_update().get(pk=edge.pk)
        believed = _workers_believed(edge, workers)
        previous = edge.applied_table_version
        if (
            applied_table_version is not None
            and previous is not None
            and applied_table_version < previous
        ):
            inventory.edge_report_store(edge=edge, at=now, workers=believed)
            refusal = Conflict(
                f"applied_table_version {applied_table_version} goes backwards: edge "
                f"{edge.name} reported version {previous} before. Liveness was recorded; "
                f"the version and instance reports were not.",
                code="table_version_backwards",
            )
        else:
            _check_published(edge, applied_table_version)
            inventory.edge_report_store(
                edge=edge, at=now, workers=believed, applied_table_version=applied_table_version
            )
            updated, unknown = _store_reports(
                edge, holder, applied_table_version, instances, budgets, cold, now
            )
    if refusal is not None:
        raise refusal
    return HeartbeatResult(edge=edge, updated_instances=updated, unknown_instances=unknown)


def _commit_without_flush() -> None:
    """This transaction's commit does not wait for its WAL to reach the disk (PostgreSQL's
    ``synchronous_commit`` off, for it alone): a heartbeat is soft state that its edge sends
    again within seconds, so a crash of the database may lose the last fraction of a second
    of them — never a table, a usage record or a change anyone made — and each heartbeat stops
    paying a disk flush (3-4 ms a commit on a busy machine, more than the rest of it)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit TO OFF")


def _store_reports(
    edge: Edge,
    holder: str,
    applied_table_version: int | None,
    instances: Sequence[InstanceReport],
    budgets: Mapping[tuple[str, str], int] | None,
    cold: Mapping[str, tuple[int, int]] | None,
    now: datetime,
) -> tuple[list[str], list[str]]:
    """What one holder (a worker of the edge) reports beside its liveness: its instances' load,
    the budgets it committed under the table it applied, and its cold demand. The caller holds
    the edge's row lock."""
    updated, unknown = _store_instance_reports(edge, holder, instances, now)
    if applied_table_version is not None:
        budget_report_store(
            edge=edge,
            holder=holder,
            table_version=applied_table_version,
            budgets=budgets or {},
            at=now,
        )
    _store_cold_report(edge, holder, cold, now)
    return updated, unknown


def _worker_heartbeat_record(
    edge: Edge,
    holder: str,
    workers: int,
    applied_table_version: int | None,
    instances: Sequence[InstanceReport],
    budgets: Mapping[tuple[str, str], int] | None,
    cold: Mapping[str, tuple[int, int]] | None,
    now: datetime,
) -> HeartbeatResult:
    """A heartbeat of worker 1 or later: liveness, its instances' load, its cold demand and
    the budgets it committed under the table it applied (its own leases)."""
    with transaction.atomic():
        _commit_without_flush()
        edge = Edge.objects.select_related("region").select_for_update().get(pk=edge.pk)
        _check_published(edge, applied_table_version)
        inventory.edge_report_store(edge=edge, at=now, workers=_workers_believed(edge, workers))
        updated, unknown = _store_reports(
            edge, holder, applied_table_version, instances, budgets, cold, now
        )
    return HeartbeatResult(edge=edge, updated_instances=updated, unknown_instances=unknown)


#: (edge, claimed workers) already logged as clamped by this process: one line each, not one
#: per heartbeat (the counter counts every one). At most edges x MAX_EDGE_WORKERS entries.
_clamp_logged: set[tuple[str, int]] = set()


def bounded_workers(claimed: int, max_workers: int) -> int:
    """What the control plane believes of a claimed worker count: never above the edge's
    configured ``max_workers`` (each worker is a lease holder and a rate-limit share, so one
    credential claiming many would shrink every other edge's share of its region)."""
    return max(1, min(claimed, max_workers))


def worker_in_bound_check(edge: Edge, worker: int) -> None:
    """A worker index at or above the edge's ``max_workers`` holds no lease and no share: its
    heartbeat is refused, naming the bound an operator may raise."""
    if worker >= edge.max_workers:
        raise ValidationError(
            {
                "worker": [
                    f"Worker {worker} is beyond edge {edge.name}'s max_workers "
                    f"{edge.max_workers}: raise the edge's max_workers to run more."
                ]
            }
        )


def _workers_believed(edge: Edge, workers: int) -> int:
    """How many worker processes the edge runs, as far as its ``max_workers`` allows (a larger
    claim is clamped and counted); a change recompiles its region's tables soon (debounced),
    so that a new worker is leased budgets and counted in every rate limit's shares without
    waiting for the periodic compile. The caller stores it (``inventory.edge_report_store``)."""
    claimed = workers
    workers = bounded_workers(claimed, edge.max_workers)
    if workers != claimed:
        metrics.HEARTBEAT_WORKERS_CLAMPED.labels(edge.name).inc()
        if (edge.name, claimed) not in _clamp_logged:
            _clamp_logged.add((edge.name, claimed))
            logger.warning(
                "edge %s claims %d workers, above its max_workers %d: counted as %d",
                edge.name,
                claimed,
                edge.max_workers,
                workers,
            )
    if edge.workers != workers:
        transaction.on_commit(routing_tables_schedule_recompile, robust=True)
    return workers


def _store_cold_report(
    edge: Edge, holder: str, cold: Mapping[str, tuple[int, int]] | None, now: datetime
) -> None:
    """Keep ``holder``'s cold report; a model with demand queues the autoscale pass."""
    if cold is None or not (cold or edge.cold_demand):
        return
    if cold_demand_store(edge, cold, now, holder):
        code = edge.region.code
        transaction.on_commit(lambda: fleet_wake_schedule(code), robust=True)


def _check_published(edge: Edge, version: int | None) -> None:
    if version is None:
        return
    latest = routing_table_latest_version(region_id=edge.region_id)
    if latest is None or version > latest:
        raise ValidationError(
            {
                "applied_table_version": [
                    f"Version {version} of region {edge.region.code}'s table was never "
                    f"published (latest: {latest if latest is not None else 'none'})."
                ]
            }
        )


#: Per-edge figures that add up across the edges of a region.
SUMMED_LOAD_FIELDS = ("tokens_per_s", "in_flight", "queued", "overflow")


def _report_age_s(report: Any, now: datetime) -> float | None:
    try:
        return (now - datetime.fromisoformat(report["reported_at"])).total_seconds()
    except (TypeError, KeyError, ValueError):
        return None


def merge_load(current: Any, *, edge: str, report: InstanceReport, now: datetime) -> dict[str, Any]:
    """An instance's load snapshot after ``edge``'s report.

    Every edge of a region sends part of the instance's traffic, so the snapshot keeps each
    edge's latest report (``edges``) and sums them: ``tokens_per_s`` (the demand the compiler
    reads), ``in_flight`` and ``queued``. Reports older than ``LOAD_REPORT_MAX_AGE_S`` (an
    edge that stopped) drop out. ``healthy`` is true while any fresh report says so.
    """
    previous = current.get("edges") if isinstance(current, dict) else None
    edges: dict[str, dict[str, Any]] = {}
    if isinstance(previous, dict):
        for name, old in previous.items():
            age = _report_age_s(old, now)
            if isinstance(old, dict) and age is not None and age <= LOAD_REPORT_MAX_AGE_S:
                edges[name] = old
    edges[edge] = {**report.load, "healthy": report.healthy, "reported_at": now.isoformat()}
    merged: dict[str, Any] = {}
    for key in SUMMED_LOAD_FIELDS:
        values = [e[key] for e in edges.values() if key in e]
        if values:
            merged[key] = sum(values)
    merged["healthy"] = any(e.get("healthy") is True for e in edges.values())
    merged["edges"] = edges
    merged["reported_at"] = now.isoformat()
    return merged


def _store_instance_reports(
    edge: Edge, holder: str, reports: Sequence[InstanceReport], now: datetime
) -> tuple[list[str], list[str]]:
    # The region row serialises its edges' heartbeats, so a down -> up change is seen once.
    region = Region.objects.select_for_update().get(pk=edge.region_id)
    names = [r.id for r in reports]
    # One read for the reported instances and the ready ones the region's health is judged
    # by (every ready instance reported unhealthy: the compiler's rule), before and after.
    rows = list(
        Instance.objects.select_for_update()
        .filter(deployment__pool__region_id=edge.region_id)
        .filter(Q(name__in=names) | Q(state=lifecycle.READY))
        .only("pk", "name", "state", "load")
        .order_by("pk")
    )
    ready = [inst for inst in rows if inst.state == lifecycle.READY]
    was_down = region_down(reported_health(inst.load, now) for inst in ready)
    reported = set(names)
    known = {inst.name: inst for inst in rows if inst.name in reported}
    loads: list[tuple[Instance, dict[str, Any]]] = []
    for report in reports:
        inst = known.get(report.id)
        if inst is None:
            continue
        # Kept on the object as it goes, so a second report of one instance merges into the first.
        inst.load = merge_load(inst.load, edge=holder, report=report, now=now)
        loads.append((inst, inst.load))
    # No audit event per heartbeat (they arrive every few seconds) and no recompile either:
    # the periodic recompile picks telemetry up. Only a region going down or coming back
    # recompiles at once; coming back starts its ramp.
    updated = inventory.instance_loads_store(loads=loads, at=now)
    down = region_down(reported_health(inst.load, now) for inst in ready)
    if was_down and not down:
        inventory.region_recovery_record(region=region, at=now)
    if was_down != down:
        transaction.on_commit(routing_tables_schedule_recompile, robust=True)
    return [i.name for i in updated], sorted(set(names) - set(known))
