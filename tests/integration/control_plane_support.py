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

from regions.supervisor import Process, Supervisor, free_port, wait_http
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


def serve(procs: Supervisor, env: dict[str, str], *, name: str = "serve") -> tuple[str, Process]:
    """Start ``fedinfer serve`` (uvicorn, no migrations) on a free loopback port and wait
    until it answers; returns its URL and process."""
    port = free_port()
    proc = procs.start(name, [FEDINFER, "serve", "--no-migrate", "--port", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/api/v1/", watch=proc)
    return url, proc


def write_table_keys(path: Path) -> Path:
    """The control plane's table-signing key as an edge's key ring (``--table-keys-file``)."""
    key_id = django_settings.FEDINFER_TABLE_SIGNING_KEY_ID
    path.write_text(f"{key_id}={django_settings.FEDINFER_TABLE_SIGNING_KEY}")
    return path


def start_control_plane_edge(
    procs: Supervisor,
    *,
    region: str,
    control_plane: str,
    credential: str,
    table_keys: Path,
    port: int,
    ops_port: int,
    env: dict[str, str],
    args: tuple[str, ...] = (),
) -> Process:
    """``fedinfer edge`` named ``edge-<region>`` on the control plane's signed tables, with
    quick probes and heartbeats; its credential is ``<log_dir>/cred-<region>`` and its last
    good table is kept under ``<log_dir>/state-<region>``. Not waited for."""
    cred = procs.log_dir / f"cred-{region}"
    cred.write_text(credential)
    cmd = [FEDINFER, "edge", "--region", region, "--control-plane", control_plane]
    cmd += ["--credential-file", str(cred), "--table-keys-file", str(table_keys)]
    cmd += ["--edge-name", f"edge-{region}", "--state-dir", str(procs.log_dir / f"state-{region}")]
    cmd += ["--port", str(port), "--operator-port", str(ops_port)]
    cmd += ["--heartbeat-interval", "0.5", "--probe-interval", "0.2", "--scrape-interval", "0.2"]
    cmd += ["--initial-timeout", "10", "--log-level", "warning", *args]
    return procs.start(f"edge-{region}", cmd, env=env)
