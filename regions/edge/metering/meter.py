"""Metering at the edge: one usage record per served request, spooled and shipped.

The record stage appends the record's row to the spool's memory once a response has ended
(streamed or not, cut or complete) — or, when the spool is full and the policy is to serve,
counts it dropped (``Recorder.finished``); the shipper encodes a batch's rows in one call. The
spool and its shipper do the I/O in the background (``usage_spool.py``, ``usage_shipper.py``).
When the spool is full — the control plane or Redis away for long — the policy decides:
``refuse`` (the default) turns new requests away with 503 until records drain, because a
request served and not billed is lost for good; ``serve`` keeps serving and counts each record
it drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from regions.edge.metering.usage_shipper import FLUSH_INTERVAL_S, UsageShipper, UsageSink
from regions.edge.metering.usage_spool import UsageSpool

log = logging.getLogger("fedinfer.edge.usage")

FullPolicy = Literal["refuse", "serve"]
#: Spool segment files roll over at this size (or at the spool's bound, if smaller).
SEGMENT_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class MeteringConfig:
    """Where records are spooled, how much may wait there, what happens when it is full, and
    where they are shipped."""

    spool_dir: Path
    max_bytes: int = 256 << 20
    full_policy: FullPolicy = "refuse"
    #: Ship to this Redis's usage stream; None: to the control plane's usage endpoint.
    redis_url: str | None = None
    #: The edge's name and MAC key on that stream (``usage_stream_key`` of its credential).
    stream_edge: str | None = None
    stream_key: bytes | None = None
    flush_interval_s: float = FLUSH_INTERVAL_S


class RequestIds:
    """Unique request ids without a syscall or a string per request: a random per-process
    prefix and a counter, written apart (schema 3) and read as ``<12 hex>-<n hex>``, unique
    across edges and restarts."""

    __slots__ = ("next_seq", "prefix")

    def __init__(self) -> None:
        self.prefix = secrets.token_hex(6) + "-"
        #: The next sequence number (``next_seq()``).
        self.next_seq = itertools.count(1).__next__


class Meter:
    # Slots: the record stage reads ``spool``, ``ids`` and the policy flags per request.
    __slots__ = (
        "_task", "cfg", "drop_when_full", "dropped", "ids", "refuse_when_full", "shipper", "spool",
    )  # fmt: skip

    def __init__(self, cfg: MeteringConfig, sink: UsageSink) -> None:
        self.cfg = cfg
        self.spool = UsageSpool(
            cfg.spool_dir, max_bytes=cfg.max_bytes, segment_bytes=min(SEGMENT_BYTES, cfg.max_bytes)
        )
        self.shipper = UsageShipper(self.spool, sink, interval_s=cfg.flush_interval_s)
        self.ids = RequestIds()
        self.dropped = 0
        # Read per request, with ``spool.full`` (admission refuses when both are true; the
        # record stage drops): the policy as two flags, not a string compared every time.
        self.refuse_when_full = cfg.full_policy == "refuse"
        self.drop_when_full = not self.refuse_when_full
        self._task: asyncio.Task[None] | None = None

    @property
    def recorded(self) -> int:
        """Records spooled (buffered or written) since the edge started."""
        return self.spool.appended

    async def start(self) -> None:
        self._task = asyncio.create_task(self.shipper.run(), name="usage-shipper")
        self._task.add_done_callback(_report_failure)

    async def stop(self) -> None:
        """Stop shipping in the background, then flush and ship what is left once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.shipper.stop()


def _report_failure(task: asyncio.Task[None]) -> None:
    """A shipper that stopped on a defect says so at once (its records stay spooled)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("usage shipping stopped", exc_info=task.exception())


class UsageCollector(Collector):
    """The meter's state at scrape time: records spooled and dropped, shipped and failed
    shipments, bytes waiting, and whether the spool is full."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        meter, stats = self.meter, self.meter.shipper.stats
        yield CounterMetricFamily(
            "fedinfer_edge_usage_records", "Usage records spooled", value=meter.recorded
        )
        yield CounterMetricFamily(
            "fedinfer_edge_usage_dropped",
            "Usage records dropped because the spool was full (--usage-spool-full serve)",
            value=meter.dropped,
        )
        yield CounterMetricFamily(
            "fedinfer_edge_usage_shipped", "Usage records the sink accepted", value=stats.shipped
        )
        yield CounterMetricFamily(
            "fedinfer_edge_usage_ship_failures",
            "Batches the sink refused or could not be reached for",
            value=stats.failures,
        )
        yield GaugeMetricFamily(
            "fedinfer_edge_usage_unshipped_bytes",
            "Bytes of usage records on disk not yet accepted by the sink",
            value=meter.spool.unshipped_bytes,
        )
        yield GaugeMetricFamily(
            "fedinfer_edge_usage_spool_full",
            "1 while the spool is full (new requests refused or served unmetered)",
            value=1 if meter.spool.full else 0,
        )
