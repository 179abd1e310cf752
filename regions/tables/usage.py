"""The usage record: what one served request consumed, as the edge that served it saw it.

A contract document like the routing table (``docs/metering.md``): the edge writes one per
request to its spool and ships it to the control plane, which prices it and attributes cost.
Ingestion is idempotent on ``request_id``, so a record shipped twice (an edge that restarts
before it learns its batch was accepted) is counted once. Pure: no Django, no I/O.

Four wire forms, one meaning. Schema 4 (what edges write) is a JSON array — the version, the
request id as a prefix and a sequence number, then the other fields in :data:`POSITIONAL_FIELDS`
order — built straight from the request's values, with no object per request and no string
formatted per request: the edge's metering budget is a few microseconds, and naming every field
in every record cost more than half of it (and doubled the bytes spooled and shipped), and
formatting the id a fifth. Schema 4 ends with the :data:`CONTINUATION_FIELDS`: a stream whose
engine died after tokens reached the client, continued on another instance (issue 31), is still
one record, billed once — ``prompt_tokens`` count the prompt once and ``completion_tokens`` are
what the client received — while what the engines processed again to continue it
(``reprefill_tokens``) is the operator's cost. Schema 3 (the same array without those four
values), schema 2 (the id one string) and schema 1 (a JSON object with named fields) are still
read: records an older edge left in its spool or in the stream when it was upgraded; they were
served by one engine each.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import msgspec

USAGE_SCHEMA_VERSION = 4
#: The schema of positional records with a split id but without the continuation fields (read,
#: no longer written).
SPLIT_ID_SCHEMA_VERSION = 3
#: The schema of positional records whose id is one string (read, no longer written).
WHOLE_ID_SCHEMA_VERSION = 2
#: The schema of named-field records (read, no longer written).
NAMED_SCHEMA_VERSION = 1
#: The Redis stream edges append records to — one entry per shipped batch, its records as
#: newline-delimited documents in field ``r`` — and the control plane's ingestion reads with a
#: consumer group.
USAGE_STREAM = "fedinfer:usage"
USAGE_FIELD = b"r"
#: The entry's sender (the edge's registered name) and its MAC over name and batch
#: (:func:`usage_batch_mac`): the worker ingests an entry only as its MAC's edge.
USAGE_EDGE_FIELD = b"e"
USAGE_MAC_FIELD = b"m"
#: The most entries the stream holds: an edge sends nothing while the stream is this long
#: (its records wait in its spool), so ``XADD``'s own ``MAXLEN`` at the same bound never has
#: anything to cut (``regions/edge/metering/usage_shipper.py``).
USAGE_STREAM_MAX_ENTRIES = 100_000


def usage_stream_key(credential: str) -> bytes:
    """The MAC key of an edge's stream entries: the SHA-256 (hex) of its credential, which is
    what the control plane stores (``Edge.credential_hash``), so neither side keeps another
    secret and a rotation changes both."""
    return hashlib.sha256(credential.encode("utf-8")).hexdigest().encode("ascii")


def usage_batch_mac(key: bytes, edge: str, batch: bytes) -> bytes:
    """HMAC-SHA256 over the edge's name, a newline (no name holds one) and the batch."""
    return hmac.new(key, edge.encode("utf-8") + b"\n" + batch, hashlib.sha256).digest()


def usage_batch_verify(key: bytes, edge: str, batch: bytes, mac: bytes) -> bool:
    """Whether ``mac`` is the edge's MAC of the batch (compared in constant time)."""
    return hmac.compare_digest(usage_batch_mac(key, edge, batch), mac)


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
    #: How many times the stream was continued on another instance after its engine was lost
    #: (0: one engine served it all; at most :data:`MAX_CONTINUATIONS`).
    continued: int = 0
    #: Every engine that served part of the answer, in order, as ``region/instance`` joined by
    #: ``,`` (``continued + 1`` of them; None when ``continued == 0``). ``instance`` is the last
    #: of them in this edge's region (the one that finished it, unless another region did).
    legs: str | None = None
    #: Why the (first) continuation happened, a short code: ``engine_lost``, ``drain``, …
    #: (None when ``continued == 0``, or why the stream was cut when it could not be continued).
    continuation_reason: str | None = None
    #: Prompt tokens the engines processed again to continue — the prompt plus the text already
    #: relayed, per continuation, summed (0 when ``continued == 0``). The operator's cost, never
    #: the tenant's price: ``prompt_tokens`` and ``completion_tokens`` stay what is billed.
    reprefill_tokens: int = 0
    #: The wire schema it was read from (records built in memory: the current one).
    schema_version: int = USAGE_SCHEMA_VERSION


#: A record's fields in array order after its version, with ``request_id`` whole (schema 4
#: splits it into :data:`SPLIT_ID_FIELDS`). Every field, no defaults.
POSITIONAL_FIELDS: tuple[str, ...] = tuple(
    f for f in UsageRecord.__struct_fields__ if f != "schema_version"
)
#: The fields schema 4 added at the end of the row (a continued stream, issue 31).
CONTINUATION_FIELDS = ("continued", "legs", "continuation_reason", "reprefill_tokens")
#: The fields of schemas 2 and 3, in order: every field up to ``edge``.
LEGACY_POSITIONAL_FIELDS: tuple[str, ...] = tuple(
    f for f in POSITIONAL_FIELDS if f not in CONTINUATION_FIELDS
)
#: The bounds of the continuation fields (``decode_record`` refuses a record beyond them; the
#: control plane's columns are as wide).
MAX_CONTINUATIONS = 16
MAX_LEGS_CHARS = 1024
MAX_CONTINUATION_REASON_CHARS = 64
#: Schema 4's (and 3's) request id: a per-process prefix and a sequence number (null: the prefix
#: is the whole id), joined as ``prefix + hex(seq)`` by whoever reads it, not by the edge per
#: request.
SPLIT_ID_FIELDS = ("request_id_prefix", "request_id_seq")


def _positional(
    name: str, head: list[tuple[str, Any]], fields: tuple[str, ...]
) -> type[msgspec.Struct]:
    """A positional wire form: its head, then ``fields`` after ``request_id`` with the types
    :class:`UsageRecord` gives them (one list of fields, so the forms cannot drift apart), every
    one required and none more allowed (a schema-3 row with schema 4's tail is refused)."""
    types = {f.name: f.type for f in msgspec.structs.fields(UsageRecord)}
    rest = [(f, types[f]) for f in fields[1:]]
    return msgspec.defstruct(
        name, head + rest, array_like=True, frozen=True, gc=False, forbid_unknown_fields=True
    )


_SPLIT_ID_HEAD: list[tuple[str, Any]] = [
    ("schema_version", int),
    ("request_id_prefix", str),
    ("request_id_seq", int | None),
]
#: Schema 4 as it travels:
#: ``[4, request_id_prefix, request_id_seq, started_at, …, edge, continued, …, reprefill_tokens]``.
_CurrentRecord = _positional("_CurrentRecord", _SPLIT_ID_HEAD, POSITIONAL_FIELDS)
#: Schema 3 as it travels: ``[3, request_id_prefix, request_id_seq, started_at, …, edge]``.
_SplitIdRecord = _positional("_SplitIdRecord", _SPLIT_ID_HEAD, LEGACY_POSITIONAL_FIELDS)
#: Schema 2 as it travels: ``[2, request_id, started_at, …, edge]``.
_WholeIdRecord = _positional(
    "_WholeIdRecord", [("schema_version", int), ("request_id", str)], LEGACY_POSITIONAL_FIELDS
)


#: A schema-4 record as the edge builds it: the version, the id's prefix and sequence number,
#: then :data:`POSITIONAL_FIELDS` after ``request_id`` in order (typed, so a misplaced value of
#: another type fails the type check).
UsageRow = tuple[
    int,  # schema_version
    str,  # request_id_prefix
    int | None,  # request_id_seq
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
    int,  # continued
    str | None,  # legs
    str | None,  # continuation_reason
    int,  # reprefill_tokens
]


class UsageRecordError(ValueError):
    """Not a usage record this version reads."""


_encoder = msgspec.json.Encoder()
_encode = _encoder.encode
_decode_current = msgspec.json.Decoder(_CurrentRecord).decode
_decode_split_id = msgspec.json.Decoder(_SplitIdRecord).decode
_decode_whole_id = msgspec.json.Decoder(_WholeIdRecord).decode
_decode_named = msgspec.json.Decoder(UsageRecord).decode


#: A batch of schema-4 rows as newline-terminated lines, in one call: the edge's shipper encodes
#: each batch so, not each request (``regions/edge/metering/usage_spool.py``).
encode_usage_lines: Callable[[list[UsageRow]], bytes] = _encoder.encode_lines


def request_id(prefix: str, seq: int | None) -> str:
    """The id a schema-4 (or 3) record names: ``prefix + hex(seq)``, or the prefix alone."""
    return prefix if seq is None else f"{prefix}{seq:x}"


def encode_record(record: UsageRecord) -> bytes:
    """A record as an edge writes it (schema 4, its id whole in the prefix)."""
    rest = (getattr(record, f) for f in POSITIONAL_FIELDS[1:])
    return _encode((USAGE_SCHEMA_VERSION, record.request_id, None, *rest))


def encode_split_id_record(record: UsageRecord) -> bytes:
    """A record as schema-3 edges wrote it, without the continuation fields (what ingestion
    still reads; a continued record loses them)."""
    rest = (getattr(record, f) for f in LEGACY_POSITIONAL_FIELDS[1:])
    return _encode((SPLIT_ID_SCHEMA_VERSION, record.request_id, None, *rest))


def encode_whole_id_record(record: UsageRecord) -> bytes:
    """A record as schema-2 edges wrote it (what ingestion still reads; a continued record
    loses the continuation fields)."""
    values = (getattr(record, f) for f in LEGACY_POSITIONAL_FIELDS)
    return _encode((WHOLE_ID_SCHEMA_VERSION, *values))


def encode_named_record(record: UsageRecord) -> bytes:
    """A record as schema-1 edges wrote it (what ingestion still reads)."""
    return _encode(msgspec.structs.replace(record, schema_version=NAMED_SCHEMA_VERSION))


def decode_record(data: bytes) -> UsageRecord:
    """Decode and check one record of any schema; raise :class:`UsageRecordError` on any
    defect."""
    try:
        record = _decode_positional(data) if data[:1] == b"[" else _decode_named_checked(data)
    except msgspec.DecodeError as exc:
        raise UsageRecordError(f"usage record does not decode: {exc}") from exc
    if not record.request_id or not record.region or not record.instance or not record.model:
        raise UsageRecordError("request_id, region, instance and model must not be empty")
    counts = (record.prompt_tokens, record.cached_tokens, record.completion_tokens)
    if min(counts) < 0 or record.cached_tokens > record.prompt_tokens:
        raise UsageRecordError("token counts must be >= 0, cached within the prompt")
    if (
        record.continued
        or record.reprefill_tokens
        or record.legs is not None
        or record.continuation_reason is not None
    ):
        _check_continuation(record)
    return record


def _check_continuation(record: UsageRecord) -> None:
    """The continuation fields of a record that has any: within their bounds, and consistent
    (a record not continued has no legs and no re-prefill; a continued one names each of its
    legs). A reason is allowed on a record not continued: why its stream was cut, when it
    could not be continued."""
    continued, legs, reason = record.continued, record.legs, record.continuation_reason
    if not 0 <= continued <= MAX_CONTINUATIONS:
        raise UsageRecordError(f"continued must be within 0..{MAX_CONTINUATIONS}")
    if record.reprefill_tokens < 0:
        raise UsageRecordError("reprefill_tokens must be >= 0")
    if reason is not None and not 0 < len(reason) <= MAX_CONTINUATION_REASON_CHARS:
        raise UsageRecordError(
            f"continuation_reason must be 1..{MAX_CONTINUATION_REASON_CHARS} characters"
        )
    if continued == 0:
        if legs is not None or record.reprefill_tokens:
            raise UsageRecordError("legs and reprefill_tokens are for a continued record only")
        return
    if legs is None or len(legs) > MAX_LEGS_CHARS:
        raise UsageRecordError(f"a continued record names its legs, within {MAX_LEGS_CHARS} chars")
    parts = legs.split(",")
    if len(parts) != continued + 1 or not all(0 < p.find("/") < len(p) - 1 for p in parts):
        raise UsageRecordError("legs must be continued + 1 'region/instance' joined by ','")


def _decode_positional(data: bytes) -> UsageRecord:
    """Schema 4, 3 or 2, told apart by the version that opens the array."""
    lead = data[1:].lstrip()[:2]
    row: Any
    if lead[:1] == b"4" and not lead[1:].isdigit():
        row = _decode_current(data)
        values = msgspec.structs.asdict(row)
        rid = request_id(values.pop("request_id_prefix"), values.pop("request_id_seq"))
    elif lead[:1] == b"3" and not lead[1:].isdigit():
        row = _decode_split_id(data)
        values = msgspec.structs.asdict(row)
        rid = request_id(values.pop("request_id_prefix"), values.pop("request_id_seq"))
    elif lead[:1] == b"2" and not lead[1:].isdigit():
        row = _decode_whole_id(data)
        values = msgspec.structs.asdict(row)
        rid = values.pop("request_id")
    else:
        version = msgspec.json.decode(data)
        raise UsageRecordError(
            f"unsupported usage schema_version {version[0] if version else None}"
        )
    return UsageRecord(request_id=rid, **values)


def _decode_named_checked(data: bytes) -> UsageRecord:
    record = _decode_named(data)
    if record.schema_version != NAMED_SCHEMA_VERSION:
        raise UsageRecordError(
            f"unsupported usage schema_version {record.schema_version}"
            " (named-field records are schema 1)"
        )
    return record
