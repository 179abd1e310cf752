"""Writes to the edge routers registered per region."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import transaction

from federation.core.audit import Actor, audit_record
from federation.core.services import model_apply, model_lock, model_save, model_validate
from federation.inventory.models import DEFAULT_EDGE_MAX_WORKERS, Edge, Region


@transaction.atomic
def edge_register(
    *,
    actor: Actor,
    region: Region,
    name: str,
    url: str,
    max_workers: int = DEFAULT_EDGE_MAX_WORKERS,
) -> Edge:
    edge = Edge(region=region, name=name, url=url, max_workers=max_workers)
    model_validate(edge)
    model_save(edge)
    audit_record(actor=actor, action="edge.register", obj=edge)
    return edge


@transaction.atomic
def edge_update(*, actor: Actor, edge: Edge, data: Mapping[str, Any]) -> Edge:
    edge = model_lock(edge)
    diff = model_apply(
        edge,
        data,
        updatable=("url", "last_heartbeat_at", "applied_table_version", "max_workers"),
    )
    model_validate(edge)
    if edge.workers > edge.max_workers:
        # A lowered bound holds at once: the tables this change recompiles (its audit event)
        # lease and share over at most that many workers.
        diff["workers"] = [edge.workers, edge.max_workers]
        edge.workers = edge.max_workers
    model_save(edge)
    if diff:
        audit_record(actor=actor, action="edge.update", obj=edge, changes=diff)
    return edge


@transaction.atomic
def edge_delete(*, actor: Actor, edge: Edge) -> None:
    audit_record(actor=actor, action="edge.delete", obj=edge)
    edge.delete()
