"""Waiting for a newer table without holding a thread: an async shell around a sync DRF view.

Django runs sync views under ASGI on one shared thread per request, so a sync view that
sleeps would hold it for the whole wait. Instead the DRF view answers at once or, when the
client already has the latest version and asked to wait, returns a marker; the async shell
then waits — on the Redis channel the publisher nudges after commit, re-checking the
database every second in case a nudge is lost, or polling the database every 100 ms when
Redis is absent or down — and runs the DRF view once more to answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse

from federation.routing.distribution import routing_table_latest_version
from federation.routing.services import nudge_channel

logger = logging.getLogger(__name__)

#: Database poll interval when no Redis nudge can arrive.
POLL_INTERVAL_S = 0.1
#: With Redis, the database is still re-read this often: a lost nudge costs at most this.
RECHECK_INTERVAL_S = 1.0
#: Keyword the shell passes on its second call so the view answers without waiting again.
WAITED = "_waited"


@dataclass(frozen=True, slots=True)
class WaitFor:
    """Hold the request until ``region_id`` has a version above ``known`` (or any version,
    when ``known`` is None), for at most ``seconds``."""

    region_id: int
    region_code: str
    known: int | None
    seconds: float


async def _subscribe(channel: str) -> Any | None:
    url = settings.REDIS_URL
    if not url:
        return None
    # Typed Any: the installed redis stubs predate the async client's aclose().
    client: Any = aredis.Redis.from_url(url, socket_connect_timeout=1)
    pubsub: Any = client.pubsub()
    try:
        await pubsub.subscribe(channel)
    except (redis.RedisError, OSError) as exc:
        logger.warning("long-poll falls back to database polling (Redis: %s)", exc)
        await pubsub.aclose()
        await client.aclose()
        return None
    return pubsub


async def wait_for_newer(wait: WaitFor) -> None:
    """Return as soon as the region has a newer version, or when the wait is over."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait.seconds
    pubsub = await _subscribe(nudge_channel(wait.region_code))
    latest_version = sync_to_async(routing_table_latest_version)
    try:
        while True:
            # Checked after subscribing: a version published in between is not missed.
            latest = await latest_version(region_id=wait.region_id)
            if latest is not None and (wait.known is None or latest > wait.known):
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            if pubsub is None:
                await asyncio.sleep(min(POLL_INTERVAL_S, remaining))
                continue
            try:
                await pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=min(RECHECK_INTERVAL_S, remaining)
                )
            except (redis.RedisError, OSError) as exc:
                logger.warning("long-poll lost Redis, polling the database: %s", exc)
                await _close(pubsub)
                pubsub = None
    finally:
        if pubsub is not None:
            await _close(pubsub)


async def _close(pubsub: Any) -> None:
    try:
        await pubsub.aclose()
        await pubsub.connection_pool.disconnect()
    except (redis.RedisError, OSError) as exc:
        logger.debug("closing a long-poll subscription: %s", exc)


def long_poll(view: Callable[..., HttpResponse]) -> Callable[..., Any]:
    """Wrap a DRF ``as_view()`` callable; keeps its attributes so routing and the OpenAPI
    generator still see the DRF view."""
    sync_view = sync_to_async(view)

    @functools.wraps(view)
    async def shell(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        response = await sync_view(request, *args, **kwargs)
        wait = getattr(response, "wait_for", None)
        if not isinstance(wait, WaitFor):
            return response
        await wait_for_newer(wait)
        return await sync_view(request, *args, **{**kwargs, WAITED: True})

    return shell
