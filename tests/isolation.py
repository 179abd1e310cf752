"""What each pytest-xdist worker keeps to itself.

Workers share this machine's PostgreSQL and Redis. pytest-django already gives each worker its
own test database (``test_fedinfer_gw0``, …); this gives each its own Redis database, so one
worker's ``flushdb`` never empties another's broker, nudges or budget leases. Ports come from
:func:`regions.supervisor.free_port`, whose ledger keeps parallel pickers apart, and files from
each test's ``tmp_path``.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

#: Redis ships 16 databases; the base one and the 7 below it serve up to 8 workers.
REDIS_DATABASES = 16
MAX_WORKERS = 8


def worker_index() -> int:
    """0 outside xdist and for its first worker (``gw0``), 1 for ``gw1``, …"""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(name.removeprefix("gw"))
    if index >= MAX_WORKERS:
        raise RuntimeError(f"at most {MAX_WORKERS} test workers share one Redis; got {name}")
    return index


def worker_redis_url(base: str) -> str:
    """``base`` (``redis://host:port/N``) moved to database ``N - worker`` (mod 16)."""
    parts = urlsplit(base)
    number = int(parts.path.lstrip("/") or 0)
    own = (number - worker_index()) % REDIS_DATABASES
    return urlunsplit(parts._replace(path=f"/{own}"))
