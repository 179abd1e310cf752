"""Locks that keep two workers from acting on one deployment (or on the regions) at once.

PostgreSQL session advisory locks: taken without waiting (a busy deployment is skipped this
pass, its holder is on it), held across the several short transactions of one pass, and
released by PostgreSQL itself if the worker holding them dies with its connection. SQLite (the
embedded mode) has no such locks and runs on one machine: there an exclusive ``flock`` on a
file under ``FEDINFER_VAR_DIR/locks`` does the same between the worker's processes, and the
kernel releases it when its process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from django.conf import settings
from django.db import connection

#: First key of the fleet's advisory locks ("flt"); the second is the object's id.
LOCK_NAMESPACE = 0x666C74
REGIONS_LOCK_ID = 0
#: The scheduled placement pass (deployments' ids are positive).
PLACEMENT_LOCK_ID = -1


@contextlib.contextmanager
def advisory_lock(object_id: int) -> Iterator[bool]:
    """Yields whether this worker holds the lock for ``object_id``; releases it on exit."""
    if connection.vendor != "postgresql":
        with _file_lock(object_id) as held:
            yield held
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", [LOCK_NAMESPACE, object_id])
        held = bool(cursor.fetchone()[0])
    try:
        yield held
    finally:
        if held:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s, %s)", [LOCK_NAMESPACE, object_id])


@contextlib.contextmanager
def _file_lock(object_id: int) -> Iterator[bool]:
    folder = settings.VAR_DIR / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f"fleet-{object_id}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
