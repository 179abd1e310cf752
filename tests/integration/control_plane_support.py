"""What the loopback control-plane tests share: a Redis DB of their own for the broker, the
debounce mark and the nudges, and the environment of the subprocesses they start."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from django.conf import settings as django_settings

from regions.supervisor import Supervisor, free_port, wait_http
from workers.celery import app as celery_app

FEDINFER = str(Path(sys.executable).with_name("fedinfer"))


@contextlib.contextmanager
def own_redis(settings: Any, url: str) -> Iterator[redis.Redis]:
    """Point the control plane (``settings``: pytest-django's fixture) and the Celery app at
    the Redis DB ``url``, flushed before and after."""
    settings.REDIS_URL = url
    settings.CELERY_BROKER_URL = url
    celery_app.conf.broker_url = url
    celery_app.close()
    # close() keeps the producer pool of the broker an earlier test used: drop it too, or this
    # test's tasks would be queued where its worker does not listen.
    celery_app.amqp._producer_pool = None
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


def subprocess_env(redis_url: str, **extra: str) -> dict[str, str]:
    """Environment of a ``fedinfer`` subprocess on this test's database and ``redis_url``."""
    db = django_settings.DATABASES["default"]
    return {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": redis_url,
        "DJANGO_SETTINGS_MODULE": "federation.settings",
        **extra,
    }


def serve(procs: Supervisor, env: dict[str, str], *, name: str = "serve") -> tuple[str, int]:
    """Start ``fedinfer serve`` (uvicorn, no migrations) on a free loopback port and wait
    until it answers; returns its URL and pid."""
    port = free_port()
    proc = procs.start(name, [FEDINFER, "serve", "--no-migrate", "--port", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/api/v1/", watch=proc)
    return url, proc.pid
