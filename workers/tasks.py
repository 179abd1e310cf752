"""Celery tasks: each calls one service and retries when the database is unavailable."""

from __future__ import annotations

from django.db import DatabaseError

from federation.routing import services as routing
from workers.celery import app


@app.task(
    name=routing.PUBLISH_TASK,
    autoretry_for=(DatabaseError,),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=10,
)
def routing_tables_publish_task(regions: list[str] | None = None) -> list[str]:
    """Compile and publish the tables whose content changed; ``region@version`` of each."""
    versions = routing.routing_tables_recompile(regions=regions)
    return [f"{v.region.code}@{v.version}" for v in versions]
