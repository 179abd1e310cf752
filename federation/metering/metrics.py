"""Metering's Prometheus series: the usage stream's backlog and the dead-letter.

The backlog gauges are read at scrape time (``federation.core.metrics.STATE``): the stream's
length (entries not yet deleted: unread plus read but not acknowledged) against its bound
(``USAGE_STREAM_MAX_ENTRIES``: at the bound edges stop sending and spool), the entries a worker
holds unacknowledged, and the dead-letter's rows. The eviction counter counts what this process
deleted from the full dead-letter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from regions.tables.usage import USAGE_STREAM, USAGE_STREAM_MAX_ENTRIES

log = logging.getLogger(__name__)

#: The consumer group the worker reads the stream with (``stream.py``).
GROUP = "ingest"

DEAD_LETTERS_EVICTED = Counter(
    "fedinfer_cp_usage_dead_letters_evicted",
    "Usage dead-letter rows deleted because the dead-letter was full (oldest first)",
)


@dataclass(frozen=True, slots=True)
class StreamBacklog:
    length: int
    pending: int


def stream_backlog(client: redis.Redis) -> StreamBacklog:
    """The usage stream's length and its group's unacknowledged entries (two commands)."""
    length = int(client.xlen(USAGE_STREAM))
    try:
        groups: Any = client.xinfo_groups(USAGE_STREAM)
    except redis.ResponseError:  # no stream yet
        groups = []
    pending = sum(int(g["pending"]) for g in groups if g["name"] in (GROUP, GROUP.encode()))
    return StreamBacklog(length=length, pending=pending)


class UsageBacklogCollector(Collector):
    """Exports the stream's backlog and the dead-letter's size on every scrape."""

    def collect(self) -> Iterator[Metric]:
        from federation.metering.models import UsageDeadLetter

        letters = GaugeMetricFamily(
            "fedinfer_cp_usage_dead_letters", "Usage documents refused and kept for an operator"
        )
        letters.add_metric([], UsageDeadLetter.objects.count())
        yield letters
        if not settings.REDIS_URL:
            return
        client = redis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2
        )
        try:
            backlog = stream_backlog(client)
        except redis.RedisError as exc:
            log.warning("usage stream backlog not exported (Redis unavailable): %s", exc)
            return
        finally:
            client.close()
        length = GaugeMetricFamily(
            "fedinfer_cp_usage_stream_entries",
            "Entries on the usage stream not yet ingested and deleted (edges stop at the bound)",
        )
        length.add_metric([], backlog.length)
        bound = GaugeMetricFamily(
            "fedinfer_cp_usage_stream_max_entries",
            "The usage stream's bound: at it, edges keep their records in their spools",
        )
        bound.add_metric([], USAGE_STREAM_MAX_ENTRIES)
        pending = GaugeMetricFamily(
            "fedinfer_cp_usage_stream_pending",
            "Usage stream entries read by a worker and not yet acknowledged",
        )
        pending.add_metric([], backlog.pending)
        yield from (length, bound, pending)
