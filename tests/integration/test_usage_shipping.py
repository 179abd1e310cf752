"""Shipping the edge's usage spool to the real Redis stream: while Redis cannot be reached the
records stay on disk (and the spool grows); once it is back each record arrives exactly once,
in order, and leaves the spool only then."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import redis

from regions.edge.usage_shipper import RedisStreamSink, UsageShipper
from regions.edge.usage_spool import UsageSpool
from regions.supervisor import free_port

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


def _closed_port_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


def _stream(name: str) -> list[bytes]:
    """The records in the stream: each entry is one shipment, its records a line each."""
    client = redis.Redis.from_url(REDIS_URL)
    entries = [fields[b"r"] for _, fields in client.xrange(name)]
    assert all(e.endswith(b"\n") for e in entries)
    return [r for e in entries for r in e.splitlines()]


def test_records_wait_on_disk_while_redis_is_away_then_arrive_once_each(
    tmp_path: Path,
) -> None:
    stream = f"test:usage:{os.getpid()}"
    redis.Redis.from_url(REDIS_URL).delete(stream)
    rows = [{"request_id": f"r{i}"} for i in range(1200)]
    records = [b'{"request_id":"r%d"}' % i for i in range(1200)]

    async def run() -> None:
        spool = UsageSpool(tmp_path / "spool")
        away = UsageShipper(spool, RedisStreamSink(_closed_port_url(), stream=stream, timeout_s=1))
        for r in rows[:700]:
            spool.append(r)
        await away.flush()
        await away.ship()
        assert away.stats.failures == 1 and away.stats.shipped == 0
        assert spool.unshipped_bytes == sum(len(r) + 1 for r in records[:700])
        await away.sink.close()

        # The edge restarts with Redis back: the spool on disk is shipped, then new records.
        spool = UsageSpool(tmp_path / "spool")
        shipper = UsageShipper(spool, RedisStreamSink(REDIS_URL, stream=stream), batch=500)
        for r in rows[700:]:
            spool.append(r)
        await shipper.stop()
        assert shipper.stats.shipped == 1200
        assert spool.unshipped_bytes == 0

    asyncio.run(run())
    assert _stream(stream) == records
    assert UsageSpool(tmp_path / "spool").read(10).records == []
    redis.Redis.from_url(REDIS_URL).delete(stream)
