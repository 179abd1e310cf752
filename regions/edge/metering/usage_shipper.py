"""Ship the usage spool to the control plane, off the request path: to the Redis usage
stream, or (without Redis) to the control plane's usage endpoint.

One background task: every ``interval_s`` it writes what the requests buffered (one fsync per
batch, in a worker thread), then sends it — from memory when nothing older waits, else what is
on disk, in batches — and acknowledges each batch in the spool only after the sink accepted it.
While the sink is down the spool grows (bounded) and the task retries with backoff; nothing is
dropped here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import httpx
import redis
import redis.asyncio as aioredis

from regions.edge.metering.usage_spool import Batch, UsageSpool
from regions.tables.usage import (
    USAGE_EDGE_FIELD,
    USAGE_FIELD,
    USAGE_MAC_FIELD,
    USAGE_STREAM,
    USAGE_STREAM_MAX_ENTRIES,
    usage_batch_mac,
)

log = logging.getLogger("fedinfer.edge.usage")


#: Seconds between batches. A batch costs ~0.3-1 ms of CPU here whatever it carries (the fdatasync,
#: the hand-off to a worker thread, the XADD): at 50 ms and 2,000 requests/s that was 3-6 µs per
#: request, most of metering's price; at 200 ms it is under 1.5 µs. What a crash loses is the
#: records of at most this long (requests in flight at a crash are not recorded at all, and a
#: Redis with ``appendfsync everysec`` may lose a second of them if its host dies).
FLUSH_INTERVAL_S = 0.2


class SinkRefused(Exception):
    """The sink answered, but did not take the batch."""


#: What a sink raises when it is away or refuses: the records stay spooled and are retried.
#: Anything else is a defect and stops the shipper loudly.
SINK_AWAY = (OSError, redis.RedisError, httpx.HTTPError, SinkRefused)


class UsageSink(Protocol):
    """Where records go; ``send`` takes a batch (records as newline-terminated lines) and
    returns only once all of them are accepted, else raises one of :data:`SINK_AWAY`."""

    async def send(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class StreamFull(SinkRefused):
    """The usage stream holds its most entries: the worker is behind (or down)."""


#: Append only while the stream is below its bound, atomically (one script: no other writer
#: can add between the length check and the append). ``MAXLEN`` is then never reached by an
#: append, so it never trims an entry the worker has not acknowledged; it bounds the stream
#: against a writer that skips this script. Returns false when full.
_APPEND_BELOW_BOUND = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return false end
return redis.call('XADD', KEYS[1], 'MAXLEN', ARGV[1], '*',
                  ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
"""


class RedisStreamSink:
    """Appends each batch to :data:`USAGE_STREAM` as one entry (newline-delimited records): all
    or none of it, and one command per batch rather than per record, which is what keeps
    metering's cost per request in microseconds.

    Each entry names its edge and carries the edge's MAC of the batch (``usage_batch_mac``,
    keyed by the SHA-256 of the edge's credential): the worker ingests it only as that edge.
    The stream is bounded at ``max_entries`` without ever losing a record: the append is refused
    (:class:`StreamFull`, treated like a sink away) while the stream is that long, so the batch
    stays in the edge's spool and is retried with backoff; the worker deletes entries only
    after it has acknowledged them."""

    def __init__(
        self,
        url: str,
        *,
        edge: str,
        key: bytes,
        stream: str = USAGE_STREAM,
        timeout_s: float = 5.0,
        max_entries: int = USAGE_STREAM_MAX_ENTRIES,
    ) -> None:
        self.stream = stream
        self.edge = edge
        self.max_entries = max_entries
        self._key = key
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._append = self._redis.register_script(_APPEND_BELOW_BOUND)

    async def send(self, data: bytes) -> None:
        mac = usage_batch_mac(self._key, self.edge, data)
        fields = (USAGE_FIELD, data, USAGE_EDGE_FIELD, self.edge.encode(), USAGE_MAC_FIELD, mac)
        added = await self._append(keys=[self.stream], args=[self.max_entries, *fields])
        if not added:
            raise StreamFull(f"usage stream {self.stream} holds {self.max_entries} entries")

    async def close(self) -> None:
        await self._redis.aclose()


class ControlPlaneSink:
    """POSTs each batch to the control plane (``/api/v1/edges/<name>/usage``, newline-
    delimited records, the edge's credential): for a control plane without Redis, as in the
    embedded demo. A 2xx means the batch is committed there."""

    def __init__(self, url: str, credential: str, *, timeout_s: float = 10.0) -> None:
        self.url = url
        self._client = httpx.AsyncClient(
            timeout=timeout_s,
            headers={
                "Authorization": f"Bearer {credential}",
                "Content-Type": "application/x-ndjson",
            },
        )

    async def send(self, data: bytes) -> None:
        resp = await self._client.post(self.url, content=data)
        if resp.status_code >= 300:
            raise SinkRefused(f"usage refused ({resp.status_code}): {resp.text[:200]}")

    async def close(self) -> None:
        await self._client.aclose()


@dataclass(slots=True)
class ShipperStats:
    shipped: int = 0
    failures: int = 0
    #: Consecutive failed sends (0 while the sink accepts).
    failing_for: int = 0


class UsageShipper:
    def __init__(
        self,
        spool: UsageSpool,
        sink: UsageSink,
        *,
        interval_s: float = FLUSH_INTERVAL_S,
        batch: int = 1000,
        max_backoff_s: float = 5.0,
        persist_s: float = 1.0,
    ) -> None:
        self.spool = spool
        self.sink = sink
        self.interval_s = interval_s
        self.batch = batch
        self.max_backoff_s = max_backoff_s
        #: How often, at most, the acknowledged cursor is written to disk (a restart re-ships
        #: at most this much; ingestion is idempotent).
        self.persist_s = persist_s
        self._persisted_at = 0.0
        self.stats = ShipperStats()

    async def run(self) -> None:
        """Flush and ship until cancelled."""
        while True:
            await asyncio.sleep(self._delay())
            await self.cycle()

    async def cycle(self) -> None:
        """Write what the requests buffered, then ship it: straight from memory when the spool
        was caught up (the common case: no read back from disk), else what waits on disk."""
        direct = self.spool.caught_up and not self.stats.failing_for
        written = await self.flush()
        if written is None:
            if not direct:
                await self.ship()  # a backlog, or a sink to try again
        elif direct and written.count <= self.batch:
            await self._send(written)
        else:
            await self.ship()

    async def flush(self) -> Batch | None:
        """Encode and write what the requests buffered (one call, one fsync); what was written,
        or None."""
        rows = self.spool.take_buffer()
        if not rows:
            return None
        return await asyncio.to_thread(self.spool.write, rows)

    async def ship(self) -> None:
        """Send what is on disk, batch after batch, until it is all sent or a send fails."""
        while True:
            batch = await asyncio.to_thread(self.spool.read, self.batch)
            if not batch.count or not await self._send(batch):
                return

    async def _send(self, batch: Batch) -> bool:
        """Send one batch; acknowledge it in the spool once the sink has accepted it."""
        try:
            await self.sink.send(batch.data)
        except SINK_AWAY as exc:  # keep the records, retry later
            self.stats.failures += 1
            self.stats.failing_for += 1
            if self.stats.failing_for == 1:
                log.warning("usage shipping failed, spooling: %s", exc)
            return False
        if self.stats.failing_for:
            log.info("usage shipping resumed after %d failures", self.stats.failing_for)
        self.stats.failing_for = 0
        self.spool.ack(batch.end)
        self.stats.shipped += batch.count
        now = time.monotonic()
        if now - self._persisted_at >= self.persist_s:
            self._persisted_at = now
            await asyncio.to_thread(self.spool.persist)
        return True

    async def stop(self) -> None:
        """On shutdown: write what is buffered, try to ship everything once, close the sink."""
        await self.flush()
        await self.ship()
        await asyncio.to_thread(self.spool.persist)
        self.spool.close()
        await self.sink.close()

    def _delay(self) -> float:
        """The interval, doubled per consecutive failure up to ``max_backoff_s``."""
        if not self.stats.failing_for:
            return self.interval_s
        return min(self.max_backoff_s, self.interval_s * 2.0 ** min(self.stats.failing_for, 16))
