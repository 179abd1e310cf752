"""Waking a deployment scaled to zero: an edge's heartbeat reports the requests it holds (or
refused) for a cold model, and the heartbeat queues the fleet's autoscale pass at once instead
of leaving them to the next periodic pass (``docs/operations.md``, scale to zero).

The task is sent by name (no domain imports the worker); at most one per region every
``FEDINFER_COLD_WAKE_SPACING_SECONDS`` (a Redis ``SET NX PX`` shared by the web processes;
without Redis, every such heartbeat queues one, which is harmless: the pass is idempotent).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import redis
from celery import current_app
from django.conf import settings

from federation.inventory import services as inventory
from federation.inventory.models import Edge
from federation.routing.selectors import LOAD_REPORT_MAX_AGE_S

logger = logging.getLogger(__name__)

AUTOSCALE_TASK = "fedinfer.fleet.autoscale"
WAKE_KEY = "fedinfer:fleet:wake:{region}"


def cold_demand_store(
    edge: Edge,
    reports: Mapping[str, tuple[int, int]],
    now: datetime,
    holder: str | None = None,
) -> list[str]:
    """Replace ``holder``'s cold report (``model -> (held, arrived)``; default: the edge's own,
    its worker 0); the models with demand in it. An edge's workers report apart: each model's
    entry adds up their fresh reports, each kept under ``holders``. The caller holds the edge's
    row lock; only the cold demand is stored (``inventory.edge_cold_demand_store``)."""
    holder = holder or edge.name
    stamp = now.isoformat()
    by_holder = _cold_by_holder(edge.cold_demand, edge.name, now)
    by_holder[holder] = {
        model: {"held": held, "arrived": arrived, "reported_at": stamp}
        for model, (held, arrived) in reports.items()
    }
    merged: dict[str, dict[str, Any]] = {}
    for name, models in sorted(by_holder.items()):
        for model, entry in models.items():
            total = merged.setdefault(
                model, {"held": 0, "arrived": 0, "reported_at": entry["reported_at"], "holders": {}}
            )
            total["held"] += entry["held"]
            total["arrived"] += entry["arrived"]
            total["reported_at"] = max(total["reported_at"], entry["reported_at"])
            total["holders"][name] = entry
    inventory.edge_cold_demand_store(edge=edge, cold_demand=dict(sorted(merged.items())))
    return sorted(m for m, (held, arrived) in reports.items() if held + arrived > 0)


def _cold_by_holder(stored: Any, edge: str, now: datetime) -> dict[str, dict[str, Any]]:
    """holder -> model -> its last entry, from a stored report (one written before workers
    had entries of their own is the edge's); entries over the age limit are dropped."""
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(stored, dict):
        return out
    for model, entry in stored.items():
        if not isinstance(entry, dict):
            continue
        holders = entry.get("holders")
        for name, own in (holders if isinstance(holders, dict) else {edge: entry}).items():
            try:
                age = (now - datetime.fromisoformat(own["reported_at"])).total_seconds()
                kept = {
                    "held": int(own["held"]),
                    "arrived": int(own["arrived"]),
                    "reported_at": own["reported_at"],
                }
            except (KeyError, TypeError, ValueError):
                continue
            if age <= LOAD_REPORT_MAX_AGE_S:  # older: a worker that stopped, as for load
                out.setdefault(name, {})[model] = kept
    return out


def fleet_wake_schedule(region: str) -> bool:
    """Queue an autoscale pass now unless one was queued for ``region`` within the spacing;
    True if queued."""
    spacing_ms = max(1, int(settings.FEDINFER_COLD_WAKE_SPACING_SECONDS * 1000))
    url = settings.REDIS_URL
    if url:
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            if not client.set(WAKE_KEY.format(region=region), "1", nx=True, px=spacing_ms):
                return False
        except redis.RedisError as exc:
            logger.warning("wake debounce unavailable, queueing anyway: %s", exc)
        finally:
            client.close()
    current_app.send_task(AUTOSCALE_TASK)
    return True
