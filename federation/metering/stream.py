"""Read the edges' usage stream into the database (the worker's ingestion loop).

A Redis consumer group: each batch of entries (an entry is one edge's shipment of records) is
read, ingested in one transaction, and acknowledged (and deleted from the stream) only after the
commit. A worker killed in between leaves its batch
pending; the next run claims batches pending longer than ``claim_idle_ms`` and ingests them
again, which ingestion's idempotency makes harmless.

Each entry is ingested as the edge it names only if it carries that edge's MAC of its batch
(``regions.tables.usage.usage_batch_mac``, keyed by the edge's stored credential hash): an
entry of an unknown edge or with a bad MAC goes whole to the dead-letter (reason "bad mac"),
and the records of a good one are checked one by one as that edge's (``admission.py``), the
refused ones kept in the dead-letter too (``models.UsageDeadLetter``): never silently dropped,
and never holding up the rest of the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import redis

from federation.inventory.models import Edge
from federation.metering.admission import UsageSender
from federation.metering.metrics import GROUP
from federation.metering.services import DeadLetterIn, usage_dead_letters_add, usage_ingest
from regions.tables.usage import (
    USAGE_EDGE_FIELD,
    USAGE_FIELD,
    USAGE_MAC_FIELD,
    USAGE_STREAM,
    usage_batch_verify,
)

log = logging.getLogger("fedinfer.metering")

BAD_MAC = "bad mac"
#: The most records one entry may carry (an edge ships at most 1,000 an entry): a larger one is
#: set aside whole rather than ingested in one unbounded transaction.
MAX_ENTRY_RECORDS = 5_000

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
    """Ingest each entry as its edge (or dead-letter it whole), then acknowledge them all."""
    ids = [entry_id for entry_id, _ in entries]
    names = {fields.get(USAGE_EDGE_FIELD, b"").decode("utf-8", "replace") for _, fields in entries}
    edges = {
        name: (key, region)
        for name, key, region in Edge.objects.filter(name__in=names).values_list(
            "name", "credential_hash", "region__code"
        )
    }
    forged: list[DeadLetterIn] = []
    for _, fields in entries:
        batch = fields.get(USAGE_FIELD, b"")
        name = fields.get(USAGE_EDGE_FIELD, b"").decode("utf-8", "replace")
        mac = fields.get(USAGE_MAC_FIELD, b"")
        key, region = edges.get(name, ("", ""))
        if not key or not usage_batch_verify(key.encode("ascii"), name, batch, mac):
            forged.append(_forged(fields, name, mac))
            continue
        lines = [line for line in batch.split(b"\n") if line]
        if len(lines) > MAX_ENTRY_RECORDS:
            letter = _forged(fields, name, mac)
            forged.append(replace(letter, reason=f"more than {MAX_ENTRY_RECORDS} records"))
            continue
        ingested = usage_ingest(
            documents=lines, sender=UsageSender(name, region), source="stream"
        )  # committed when it returns
        result.records += ingested.accepted
        result.rejected += len(ingested.rejected)
        result.budgeted = result.budgeted or ingested.budgeted
    if forged:
        usage_dead_letters_add(letters=forged)
        result.rejected += len(forged)
        log.error("%d usage stream entries set aside whole (see the dead-letter)", len(forged))
    with client.pipeline(transaction=True) as pipe:
        pipe.xack(USAGE_STREAM, GROUP, *ids)
        pipe.xdel(USAGE_STREAM, *ids)
        pipe.execute()
    result.batches += 1


def _forged(fields: dict[bytes, bytes], name: str, mac: bytes) -> DeadLetterIn:
    """An entry not authenticated as the edge it names, kept whole (its batch, else all of its
    fields) with its MAC, so a replay can check it again."""
    batch = fields.get(USAGE_FIELD)
    document = batch if batch is not None else repr(fields).encode()
    return DeadLetterIn(
        source="stream",
        edge=name,
        region="",
        document=document,
        reason=BAD_MAC if batch is not None else "stream entry has no record",
        authenticated=False,
        mac=mac.hex()[:64],
    )
