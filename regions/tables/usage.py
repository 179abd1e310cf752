"""The usage record: what one served request consumed, as the edge that served it saw it.

A contract document like the routing table (``docs/usage-record.md``): the edge writes one per
request to its spool and ships it to the control plane, which prices it and attributes cost.
Ingestion is idempotent on ``request_id``, so a record shipped twice (an edge that restarts
before it learns its batch was accepted) is counted once. Pure: no Django, no I/O.
"""

from __future__ import annotations

import msgspec

USAGE_SCHEMA_VERSION = 1
#: The Redis stream edges append records to — one entry per shipped batch, its records as
#: newline-delimited documents in field ``r`` — and the control plane's ingestion reads with a
#: consumer group.
USAGE_STREAM = "fedinfer:usage"
USAGE_FIELD = b"r"


class UsageRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One request the edge forwarded to an engine, once its response has ended. (Scalars
    only, so the garbage collector need not track one per request: ``gc=False``.)"""

    request_id: str
    #: Wall-clock Unix time the edge received the request, seconds (the record's time: rollups
    #: and partitions go by it, so a replay lands in the same hour).
    started_at: float
    region: str
    #: Region whose edge the client called (differs from ``region`` when it spilled over).
    entry_region: str
    instance: str
    #: Base model that served it, and the adapter the client named (None: the base model).
    model: str
    adapter: str | None = None
    #: Tenant slug and the key's public prefix (None: the edge runs without tenants).
    tenant: str | None = None
    key_prefix: str | None = None
    #: Tokens as the engine reported them; ``cached_tokens`` is the part of the prompt served
    #: from its prefix cache. Without a usage report (a cut stream), the prompt is the edge's
    #: count and the completion what it relayed.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    #: From receipt to the first token relayed (None: none was) and to the response's end, ms.
    ttft_ms: float | None = None
    duration_ms: float = 0.0
    status: int = 200
    streamed: bool = False
    #: The client went away before the response ended: charged what was generated.
    cancelled: bool = False
    #: Whether the engine reported the counts (False: the edge's own count stands in).
    usage_reported: bool = True
    #: The edge that served it (None: an edge without a name, in file mode): its budget
    #: lease is measured against the spend counted under this name.
    edge: str | None = None
    schema_version: int = USAGE_SCHEMA_VERSION


class UsageRecordError(ValueError):
    """Not a usage record this version reads."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(UsageRecord)


def encode_record(record: UsageRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(data: bytes) -> UsageRecord:
    """Decode and check one record; raise :class:`UsageRecordError` on any defect."""
    try:
        record = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise UsageRecordError(f"usage record does not decode: {exc}") from exc
    if record.schema_version != USAGE_SCHEMA_VERSION:
        raise UsageRecordError(f"unsupported usage schema_version {record.schema_version}")
    if not record.request_id or not record.region or not record.instance or not record.model:
        raise UsageRecordError("request_id, region, instance and model must not be empty")
    counts = (record.prompt_tokens, record.cached_tokens, record.completion_tokens)
    if min(counts) < 0 or record.cached_tokens > record.prompt_tokens:
        raise UsageRecordError("token counts must be >= 0, cached within the prompt")
    return record
