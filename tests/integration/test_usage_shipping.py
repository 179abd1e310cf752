"""Shipping the edge's usage spool to the real Redis stream: while Redis cannot be reached the
records stay on disk (and the spool grows); once it is back each record arrives exactly once,
in order, and leaves the spool only then."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import redis

from regions.edge.metering.usage_shipper import RedisStreamSink, UsageShipper
from regions.edge.metering.usage_spool import UsageSpool
from regions.supervisor import free_port
from regions.tables.usage import (
    USAGE_EDGE_FIELD,
    USAGE_MAC_FIELD,
    usage_batch_verify,
    usage_stream_key,
)

REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)
KEY = usage_stream_key("the-edge-credential")


def _sink(url: str, stream: str, **kw: object) -> RedisStreamSink:
    return RedisStreamSink(url, edge="edge-1", key=KEY, stream=stream, **kw)  # type: ignore[arg-type]


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
        away = UsageShipper(spool, _sink(_closed_port_url(), stream, timeout_s=1))
        for r in rows[:700]:
            spool.append(r)
        await away.flush()
        await away.ship()
        assert away.stats.failures == 1 and away.stats.shipped == 0
        assert spool.unshipped_bytes == sum(len(r) + 1 for r in records[:700])
        await away.sink.close()

        # The edge restarts with Redis back: the spool on disk is shipped, then new records.
        spool = UsageSpool(tmp_path / "spool")
        shipper = UsageShipper(spool, _sink(REDIS_URL, stream), batch=500)
        for r in rows[700:]:
            spool.append(r)
        await shipper.stop()
        assert shipper.stats.shipped == 1200
        assert spool.unshipped_bytes == 0

    asyncio.run(run())
    assert _stream(stream) == records
    assert UsageSpool(tmp_path / "spool").read(10).records == []
    redis.Redis.from_url(REDIS_URL).delete(stream)


def test_each_entry_names_its_edge_and_carries_its_mac(tmp_path: Path) -> None:
    stream = f"test:usage:mac:{os.getpid()}"
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(stream)

    async def run() -> None:
        spool = UsageSpool(tmp_path / "spool")
        shipper = UsageShipper(spool, _sink(REDIS_URL, stream))
        spool.append({"request_id": "r1"})
        await shipper.stop()

    asyncio.run(run())
    [(_, fields)] = client.xrange(stream)
    assert fields[USAGE_EDGE_FIELD] == b"edge-1"
    assert usage_batch_verify(KEY, "edge-1", fields[b"r"], fields[USAGE_MAC_FIELD])
    assert not usage_batch_verify(KEY, "edge-2", fields[b"r"], fields[USAGE_MAC_FIELD])
    client.delete(stream)


def test_a_full_stream_leaves_the_records_in_the_spool_until_the_worker_catches_up(
    tmp_path: Path,
) -> None:
    """At its bound the stream refuses the append (nothing trimmed, nothing dropped): the batch
    stays spooled and is shipped once the worker has deleted what it ingested."""
    stream = f"test:usage:full:{os.getpid()}"
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(stream)
    backlog = [client.xadd(stream, {b"r": b"older %d\n" % i}) for i in range(3)]

    async def run() -> None:
        spool = UsageSpool(tmp_path / "spool")
        shipper = UsageShipper(spool, _sink(REDIS_URL, stream, max_entries=3))
        spool.append({"request_id": "kept"})
        await shipper.cycle()
        assert shipper.stats.failing_for == 1 and shipper.stats.shipped == 0
        assert spool.unshipped_bytes > 0
        assert client.xlen(stream) == 3  # the backlog intact: no entry trimmed
        client.xdel(stream, backlog[0])  # the worker ingested and deleted one
        await shipper.cycle()
        assert shipper.stats.shipped == 1 and spool.unshipped_bytes == 0
        await shipper.stop()

    asyncio.run(run())
    assert client.xlen(stream) == 3
    assert [f[b"r"] for _, f in client.xrange(stream)][-1] == b'{"request_id":"kept"}\n'
    client.delete(stream)
