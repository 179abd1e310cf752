"""Read the edges' usage stream into the database (the worker's ingestion loop).

A Redis consumer group: each batch of entries (an entry is one edge's shipment of records) is
read, ingested in one transaction, and acknowledged (and deleted from the stream) only after the
commit. A worker killed in between leaves its batch
pending; the next run claims batches pending longer than ``claim_idle_ms`` and ingests them
again, which ingestion's idempotency makes harmless. Documents that are not usage records go to
:data:`REJECTED_STREAM` with the reason, for an operator to look at: never silently dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis

from federation.metering.services import usage_ingest
from regions.tables.usage import USAGE_FIELD, USAGE_STREAM

log = logging.getLogger("fedinfer.metering")

GROUP = "ingest"
REJECTED_STREAM = USAGE_STREAM + ":rejected"

Entry = tuple[bytes, dict[bytes, bytes]]


@dataclass(slots=True)
class ConsumeResult:
    batches: int = 0
    records: int = 0
    rejected: int = 0
    #: Some record was of a tenant with a budget (``IngestResult.budgeted``).
    budgeted: bool = False


def usage_stream_consume(
    client: redis.Redis,
    *,
    consumer: str,
    batch: int = 8,
    max_batches: int = 50,
    claim_idle_ms: int = 60_000,
) -> ConsumeResult:
    """Ingest up to ``max_batches`` batches of ``batch`` entries (an edge ships at most 1,000
    records an entry): first those a dead consumer left pending, then new ones; stop when the
    stream has nothing more for this group."""
    _ensure_group(client)
    result = ConsumeResult()
    while result.batches < max_batches:
        entries = _claim_stale(client, consumer, batch, claim_idle_ms) or _read_new(
            client, consumer, batch
        )
        if not entries:
            break
        _ingest(client, entries, result)
    return result


def _ensure_group(client: redis.Redis) -> None:
    try:
        client.xgroup_create(USAGE_STREAM, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _claim_stale(client: redis.Redis, consumer: str, batch: int, idle_ms: int) -> list[Entry]:
    reply: Any = client.xautoclaim(
        USAGE_STREAM, GROUP, consumer, min_idle_time=idle_ms, start_id="0-0", count=batch
    )
    entries: list[Entry] = reply[1]
    return entries


def _read_new(client: redis.Redis, consumer: str, batch: int) -> list[Entry]:
    reply: Any = client.xreadgroup(GROUP, consumer, {USAGE_STREAM: ">"}, count=batch)
    entries: list[Entry] = reply[0][1] if reply else []
    return entries


def _ingest(client: redis.Redis, entries: list[Entry], result: ConsumeResult) -> None:
    ids = [entry_id for entry_id, _ in entries]
    documents: list[bytes] = []
    malformed: list[tuple[bytes, str]] = []
    for entry_id, fields in entries:
        batch = fields.get(USAGE_FIELD)
        if batch is None:
            malformed.append((repr(fields).encode(), f"stream entry {entry_id!r} has no record"))
        else:
            documents += [line for line in batch.split(b"\n") if line]
    ingested = usage_ingest(documents=documents)  # committed when it returns
    rejected = malformed + ingested.rejected
    if rejected:
        log.error("%d usage documents rejected (see %s)", len(rejected), REJECTED_STREAM)
        with client.pipeline(transaction=True) as pipe:
            for document, reason in rejected:
                pipe.xadd(REJECTED_STREAM, {b"document": document, b"reason": reason})
            pipe.execute()
    with client.pipeline(transaction=True) as pipe:
        pipe.xack(USAGE_STREAM, GROUP, *ids)
        pipe.xdel(USAGE_STREAM, *ids)
        pipe.execute()
    result.batches += 1
    result.records += ingested.accepted
    result.rejected += len(rejected)
    result.budgeted = result.budgeted or ingested.budgeted
