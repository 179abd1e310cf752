"""Writes of what edges report in their heartbeats (ingested by ``federation.telemetry``): an
edge's liveness, applied table version, worker count and cold demand, the load of its region's
instances, and a region coming back up.

Telemetry, not a change anyone made: no audit event (heartbeats arrive every few seconds), so
nothing here schedules a recompile; the caller schedules the few reports that matter (a region
down or back up, a new worker count). The caller holds the rows' locks, in its transaction, and
has validated what it stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import orjson
from django.db import connection

from federation.inventory.models import Edge, Instance, Region


def edge_report_store(
    *, edge: Edge, at: datetime, workers: int, applied_table_version: int | None = None
) -> Edge:
    """The edge is alive at ``at`` and runs ``workers`` worker processes; with
    ``applied_table_version``, it serves that table version (None: as before)."""
    edge.last_heartbeat_at = at
    edge.workers = workers
    fields = ["last_heartbeat_at", "workers"]
    if applied_table_version is not None:
        edge.applied_table_version = applied_table_version
        fields.append("applied_table_version")
    edge.save(update_fields=fields)
    return edge


def edge_cold_demand_store(*, edge: Edge, cold_demand: dict[str, Any]) -> Edge:
    """The edge's demand for cold models, merged over its workers (``telemetry.wake``)."""
    edge.cold_demand = cold_demand
    edge.save(update_fields=["cold_demand"])
    return edge


def instance_loads_store(
    *, loads: Sequence[tuple[Instance, dict[str, Any]]], at: datetime
) -> list[Instance]:
    """Each instance's load snapshot (merged over its region's edges), heard of at ``at``;
    one query for all of them. On PostgreSQL an ``UPDATE … FROM unnest(…)``: Django's
    ``bulk_update`` builds a CASE expression per row and cost a heartbeat of 96 instances
    67 ms of CPU, most of its time."""
    updated: list[Instance] = []
    for instance, load in loads:
        instance.load = load
        instance.last_heartbeat_at = at
        updated.append(instance)
    if not updated:
        return updated
    if connection.vendor != "postgresql":  # the embedded demo's SQLite
        Instance.objects.bulk_update(updated, ["load", "last_heartbeat_at"])
        return updated
    table = connection.ops.quote_name(Instance._meta.db_table)
    # One JSON object {pk: load} as the only large parameter: the client-side binding Django
    # uses quotes it as one string, where a text[] of documents escapes every double quote.
    by_pk = orjson.dumps({str(i.pk): i.load for i in updated}).decode()
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} AS i SET load = v.load, last_heartbeat_at = %s "
            "FROM jsonb_each(%s::jsonb) AS v(id, load) WHERE i.id = v.id::bigint",
            [at, by_pk],
        )
    return updated


def region_recovery_record(*, region: Region, at: datetime) -> Region:
    """The region's edges saw it come back up at ``at``: its traffic returns in a ramp from
    then (``federation.routing.ramp``)."""
    region.recovered_at = at
    region.save(update_fields=["recovered_at", "updated_at"])
    return region
