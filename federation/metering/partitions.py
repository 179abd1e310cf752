"""Monthly partitions of the usage table on PostgreSQL.

Ingestion makes the partition of every month it is about to write to (:func:`ensure_months`),
so no row ever lacks one; an operator keeps months of history by keeping partitions and drops
or detaches old months whole (``docs/metering.md``). Other databases (the embedded SQLite of
``make demo``) have one plain table.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connection

TABLE = "metering_usagerecord"


def partition_name(year: int, month: int) -> str:
    return f"{TABLE}_y{year:04d}m{month:02d}"


def ensure_months(months: Iterable[tuple[int, int]]) -> None:
    """Create the partition of each ``(year, month)`` that has none yet (PostgreSQL only)."""
    if connection.vendor != "postgresql":
        return
    wanted = {partition_name(y, m): (y, m) for y, m in set(months)}
    with connection.cursor() as cursor:
        cursor.execute("SELECT relname FROM pg_class WHERE relname = ANY(%s)", [list(wanted)])
        for (name,) in cursor.fetchall():
            del wanted[name]
        for year, month in sorted(wanted.values()):
            following = (year + 1, 1) if month == 12 else (year, month + 1)
            cursor.execute(
                f"CREATE TABLE IF NOT EXISTS {partition_name(year, month)} PARTITION OF {TABLE} "
                f"FOR VALUES FROM ('{year:04d}-{month:02d}-01 00:00:00+00') "
                f"TO ('{following[0]:04d}-{following[1]:02d}-01 00:00:00+00')"
            )
