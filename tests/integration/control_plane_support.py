"""What the loopback control-plane tests share: a Redis DB of their own for the broker, the
debounce mark and the nudges, and the environment of the subprocesses they start."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from django.conf import settings as django_settings

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


@dataclass
class Procs:
    """The processes a test starts (each in its own session, output in ``<tmp>/<name>.log``)."""

    tmp: Path
    running: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with (self.tmp / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.running.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


def stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group we started (uvicorn or celery and their children)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(procs: Procs, env: dict[str, str], *, name: str = "serve") -> tuple[str, int]:
    """Start ``fedinfer serve`` (uvicorn, no migrations) on a free loopback port and wait
    until it answers; returns its URL and pid."""
    port = free_port()
    proc = procs.start(name, [FEDINFER, "serve", "--no-migrate", "--port", str(port)], env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, procs.log(name)
        assert time.monotonic() < deadline, f"fedinfer serve did not start: {procs.log(name)}"
        try:
            httpx.get(f"{url}/api/v1/", timeout=1)
            return url, proc.pid
        except httpx.TransportError:
            time.sleep(0.1)
