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

import redis
from celery import current_app
from django.conf import settings

from federation.inventory.models import Edge

logger = logging.getLogger(__name__)

AUTOSCALE_TASK = "fedinfer.fleet.autoscale"
WAKE_KEY = "fedinfer:fleet:wake:{region}"


def cold_demand_store(
    edge: Edge, reports: Mapping[str, tuple[int, int]], now: datetime
) -> list[str]:
    """Replace the edge's cold report (``model -> (held, arrived)``); the models with demand.
    The caller holds the edge's row lock and saves nothing else of it here."""
    edge.cold_demand = {
        model: {"held": held, "arrived": arrived, "reported_at": now.isoformat()}
        for model, (held, arrived) in sorted(reports.items())
    }
    edge.save(update_fields=["cold_demand"])
    return sorted(m for m, (held, arrived) in reports.items() if held + arrived > 0)


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
