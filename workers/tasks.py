"""Celery tasks: each calls one service and retries when the database is unavailable."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import redis
from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone

from federation.core.metrics import USAGE_REJECTED
from federation.fleet import placing
from federation.fleet import services as fleet
from federation.fleet.autoscaling import fleet_autoscale
from federation.metering import rollups
from federation.metering.stream import usage_stream_consume
from federation.routing import services as routing
from workers.celery import app
from workers.provisioners import configured_provisioners


@app.task(
    name=routing.PUBLISH_TASK,
    autoretry_for=(DatabaseError,),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=10,
)
def routing_tables_publish_task(
    regions: list[str] | None = None, due_at: float | None = None
) -> list[str]:
    """Compile and publish the tables whose content changed; ``region@version`` of each.
    ``due_at``: when a queued publish was due (``routing_tables_recompile``)."""
    versions = routing.routing_tables_recompile(regions=regions, due_at=due_at)
    return [f"{v.region.code}@{v.version}" for v in versions]


@app.task(name="fedinfer.routing_tables.prune", autoretry_for=(DatabaseError,), max_retries=3)
def routing_tables_prune_task() -> int:
    """Delete the published table versions past their retention; how many."""
    return routing.routing_tables_prune(
        keep=settings.FEDINFER_TABLE_VERSIONS_KEPT,
        older_than=timezone.now() - timedelta(hours=settings.FEDINFER_TABLE_RETENTION_HOURS),
    )


@app.task(
    name="fedinfer.usage.ingest",
    autoretry_for=(DatabaseError, redis.ConnectionError, redis.TimeoutError),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=10,
)
def usage_ingest_task() -> int:
    """Ingest what the edges put on the usage stream (acknowledged after each commit); when a
    budgeted tenant's spend was counted, re-lease budgets to the edges."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        consumer = f"{socket.gethostname()}-{os.getpid()}"
        result = usage_stream_consume(client, consumer=consumer)
    finally:
        client.close()
    USAGE_REJECTED.inc(result.rejected)
    if result.budgeted:
        routing.routing_tables_schedule_budget_release()
    return result.records


@app.task(
    name="fedinfer.usage.rollup",
    autoretry_for=(DatabaseError,),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=10,
)
def usage_rollup_task() -> int:
    """Give every closed hour its rollup, then recompute the stale hours; how many."""
    rollups.usage_hours_close(now=timezone.now())
    return len(rollups.usage_hours_refresh(limit=200))


@app.task(
    name="fedinfer.fleet.reconcile",
    autoretry_for=(DatabaseError,),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=5,
)
def fleet_reconcile_task() -> list[str]:
    """Move every provisioned instance along its lifecycle and keep replica counts at
    ``desired_replicas``; what was done."""
    return fleet.fleet_reconcile(provisioners=configured_provisioners())


@app.task(
    name="fedinfer.fleet.failover",
    autoretry_for=(DatabaseError,),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=5,
)
def fleet_failover_task() -> list[str]:
    """Evacuate regions in trouble and restore those the fleet evacuated once stable."""
    return fleet.fleet_failover()


@app.task(
    name="fedinfer.fleet.autoscale",
    autoretry_for=(DatabaseError,),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=5,
)
def fleet_autoscale_task() -> list[str]:
    """Set ``desired_replicas`` of the autoscaled deployments from their edges' load
    reports; the changes made. A change queues the reconcile pass at once, so a replica
    starts now rather than at the next periodic pass (a cold start is long enough)."""
    done = fleet_autoscale()
    if done:
        fleet_reconcile_task.delay()
    return done


@app.task(
    name="fedinfer.fleet.placement",
    autoretry_for=(DatabaseError,),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=5,
)
def fleet_placement_task() -> str:
    """The placement planner's scheduled pass (``FEDINFER_PLACEMENT_MODE``: keep the plan, or
    apply it); what happened (empty: another worker is on it). An applied plan queues the
    reconcile pass at once."""
    done = placing.placement_scheduled(apply=settings.FEDINFER_PLACEMENT_MODE == "apply")
    if done is None:
        return ""
    if done.applied:
        fleet_reconcile_task.delay()
    return str(done)
