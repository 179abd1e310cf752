"""The usage record: what one served request consumed, as the edge that served it saw it.

A contract document like the routing table (``docs/metering.md``): the edge writes one per
request to its spool and ships it to the control plane, which prices it and attributes cost.
Ingestion is idempotent on ``request_id``, so a record shipped twice (an edge that restarts
before it learns its batch was accepted) is counted once. Pure: no Django, no I/O.

Two wire forms, one meaning. Schema 2 (what edges write) is a JSON array — the version, then the
fields in :data:`POSITIONAL_FIELDS` order — built straight from the request's values, with no
object per request: the edge's metering budget is a few microseconds, and naming every field in
every record cost more than half of it (and doubled the bytes spooled and shipped). Schema 1, a
JSON object with named fields, is still read: records an older edge left in its spool or in the
stream when it was upgraded.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

USAGE_SCHEMA_VERSION = 2
#: The schema of named-field records (read, no longer written).
NAMED_SCHEMA_VERSION = 1
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
    #: The wire schema it was read from (records built in memory: the current one).
    schema_version: int = USAGE_SCHEMA_VERSION


#: A schema-2 record's fields after its version, in array order (every field, no defaults).
POSITIONAL_FIELDS: tuple[str, ...] = tuple(
    f for f in UsageRecord.__struct_fields__ if f != "schema_version"
)


class _PositionalRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Schema 2 as it travels: ``[2, request_id, started_at, …, edge]`` (see
    :data:`POSITIONAL_FIELDS`); decoded with the same types and then made a :class:`UsageRecord`."""

    schema_version: int
    request_id: str
    started_at: float
    region: str
    entry_region: str
    instance: str
    model: str
    adapter: str | None
    tenant: str | None
    key_prefix: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    duration_ms: float
    status: int
    streamed: bool
    cancelled: bool
    usage_reported: bool
    edge: str | None


#: A schema-2 record as the edge builds it: the version, then :data:`POSITIONAL_FIELDS` in order
#: (typed, so a misplaced value of another type fails the type check).
UsageRow = tuple[
    int,  # schema_version
    str,  # request_id
    float,  # started_at
    str,  # region
    str,  # entry_region
    str,  # instance
    str,  # model
    str | None,  # adapter
    str | None,  # tenant
    str | None,  # key_prefix
    int,  # prompt_tokens
    int,  # cached_tokens
    int,  # completion_tokens
    float | None,  # ttft_ms
    float,  # duration_ms
    int,  # status
    bool,  # streamed
    bool,  # cancelled
    bool,  # usage_reported
    str | None,  # edge
]


class UsageRecordError(ValueError):
    """Not a usage record this version reads."""


_encode = msgspec.json.Encoder().encode
_decode_positional = msgspec.json.Decoder(_PositionalRecord).decode
_decode_named = msgspec.json.Decoder(UsageRecord).decode


#: One schema-2 record from its row: the edge's request path, so the encoder itself, not a
#: Python function around it (a call is a tenth of the record's cost).
encode_usage: Callable[[UsageRow], bytes] = _encode


def encode_record(record: UsageRecord) -> bytes:
    """A record as an edge writes it (schema 2)."""
    return _encode((USAGE_SCHEMA_VERSION, *(getattr(record, f) for f in POSITIONAL_FIELDS)))


def encode_named_record(record: UsageRecord) -> bytes:
    """A record as schema-1 edges wrote it (what ingestion still reads)."""
    return _encode(msgspec.structs.replace(record, schema_version=NAMED_SCHEMA_VERSION))


def decode_record(data: bytes) -> UsageRecord:
    """Decode and check one record of either schema; raise :class:`UsageRecordError` on any
    defect."""
    try:
        if data[:1] == b"[":
            row = _decode_positional(data)
            if row.schema_version != USAGE_SCHEMA_VERSION:
                raise UsageRecordError(f"unsupported usage schema_version {row.schema_version}")
            record = UsageRecord(**msgspec.structs.asdict(row))
        else:
            record = _decode_named(data)
            if record.schema_version != NAMED_SCHEMA_VERSION:
                raise UsageRecordError(
                    f"unsupported usage schema_version {record.schema_version}"
                    " (named-field records are schema 1)"
                )
    except msgspec.DecodeError as exc:
        raise UsageRecordError(f"usage record does not decode: {exc}") from exc
    if not record.request_id or not record.region or not record.instance or not record.model:
        raise UsageRecordError("request_id, region, instance and model must not be empty")
    counts = (record.prompt_tokens, record.cached_tokens, record.completion_tokens)
    if min(counts) < 0 or record.cached_tokens > record.prompt_tokens:
        raise UsageRecordError("token counts must be >= 0, cached within the prompt")
    return record
