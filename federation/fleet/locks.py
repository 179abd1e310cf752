"""Locks that keep two workers from acting on one deployment (or on the regions) at once.

PostgreSQL session advisory locks: taken without waiting (a busy deployment is skipped this
pass, its holder is on it), held across the several short transactions of one pass, and
released by PostgreSQL itself if the worker holding them dies with its connection. SQLite (the
embedded demo) has no such locks; there a single worker runs every task in one process, so
there is nobody to exclude.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from django.db import connection

#: First key of the fleet's advisory locks ("flt"); the second is the object's id.
LOCK_NAMESPACE = 0x666C74
REGIONS_LOCK_ID = 0


@contextlib.contextmanager
def advisory_lock(object_id: int) -> Iterator[bool]:
    """Yields whether this worker holds the lock for ``object_id``; releases it on exit."""
    if connection.vendor != "postgresql":
        yield True
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
