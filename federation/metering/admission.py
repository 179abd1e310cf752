"""What a usage record must be to be billed: one set of checks for every path it comes by (the
Redis stream, the HTTP endpoint, an operator's replay of a dead letter). Pure, no Django: the
facts it checks against (tenants' residency, models, the sender's region) are loaded once per
batch by the caller (``services.usage_ingest``).

Two layers:

* :func:`storable_time` and :func:`column_fault` hold for every record whoever sent it: a
  record that would not convert or not fit its columns would fail the whole batch's insert,
  so it is refused alone instead.
* :func:`sender_fault` holds for records from an edge (``UsageSender``): its own region and
  name, a tenant that region may serve, a known model, and a time within the window below.

The window: not more than :data:`CLOCK_SKEW` ahead, not older than :data:`USAGE_LATE_LIMIT`. A
month's statement is final only once its end is :data:`USAGE_LATE_LIMIT` behind
(``selectors.tenant_statement``), so no admitted record can land in a final month, and an
edge can make ingestion create partitions of two months at most.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from federation.tenancy.residency import ResidencyPolicy, region_allowed
from regions.tables.schema import holds_for
from regions.tables.usage import MAX_CONTINUATION_REASON_CHARS, MAX_LEGS_CHARS, UsageRecord

#: How late a record may arrive from an edge (a spool replayed after an outage): older ones
#: go to the dead-letter. Also how long after a month's end its statements stay open.
USAGE_LATE_LIMIT = timedelta(days=7)
#: How far ahead of the control plane's clock an edge's clock may be.
CLOCK_SKEW = timedelta(minutes=5)

#: Column bounds (``models.UsageRecord``): PostgreSQL's integer, smallint and varchar sizes.
MAX_INT = 2**31 - 1
MAX_SMALLINT = 2**15 - 1
STRING_COLUMNS: dict[str, int] = {
    "request_id": 64,
    "tenant": 63,
    "key_prefix": 32,
    "model": 128,
    "adapter": 128,
    "region": 63,
    "entry_region": 63,
    "instance": 63,
    "edge": 63,
    "legs": MAX_LEGS_CHARS,
    "continuation_reason": MAX_CONTINUATION_REASON_CHARS,
}
INT_COLUMNS: dict[str, int] = {
    "prompt_tokens": MAX_INT,
    "cached_tokens": MAX_INT,
    "completion_tokens": MAX_INT,
    "status": MAX_SMALLINT,
    "continued": MAX_SMALLINT,
    "reprefill_tokens": MAX_INT,
}
#: ``price_usd`` is ``numeric(24, 12)``: under 10**12 dollars.
MAX_PRICE_USD = 10**12
#: Unix seconds of the last moment a ``datetime`` holds (9999-12-31T23:59:59Z).
_MAX_TIMESTAMP = 253_402_300_799


class UsageFault(ValueError):
    """Why a record is refused (its message is the reason kept in the dead-letter)."""


@dataclass(frozen=True, slots=True)
class UsageSender:
    """Who sent a batch, as authenticated (credential or stream MAC): the edge and its region."""

    edge: str
    region: str


@dataclass(frozen=True, slots=True)
class SenderFacts:
    """What the sender checks need, loaded once per batch."""

    now: datetime
    #: The sender's region's jurisdiction.
    jurisdiction: str
    #: Slug -> residency policy, of the batch's tenants that exist.
    tenants: Mapping[str, ResidencyPolicy]
    #: Names of the batch's models that exist.
    models: frozenset[str]


def storable_time(record: UsageRecord) -> datetime:
    """The record's ``started_at`` as a UTC datetime; :class:`UsageFault` when it has none."""
    t = record.started_at
    if not math.isfinite(t) or not 0 <= t <= _MAX_TIMESTAMP:
        raise UsageFault(f"started_at {t!r} is not a time")
    return datetime.fromtimestamp(t, tz=UTC)


def column_fault(record: UsageRecord) -> str | None:
    """Why the record does not fit its columns, or None."""
    for name, limit in STRING_COLUMNS.items():
        value = getattr(record, name)
        if value is not None and (len(value) > limit or "\x00" in value):
            return f"{name} longer than {limit} characters or with a NUL"
    for name, top in INT_COLUMNS.items():
        if not 0 <= getattr(record, name) <= top:
            return f"{name} outside 0..{top}"
    for name in ("ttft_ms", "duration_ms"):
        value = getattr(record, name)
        if value is not None and not math.isfinite(value):
            return f"{name} is not a finite number"
    return None


def sender_fault(
    record: UsageRecord, at: datetime, sender: UsageSender, facts: SenderFacts
) -> str | None:
    """Why the sender may not bill this record, or None."""
    if record.region != sender.region:
        return f"a record of region {record.region!r}"
    if not holds_for(sender.edge, record.edge or ""):
        return f"a record of edge {record.edge!r}"
    if at > facts.now + CLOCK_SKEW:
        return f"started_at {at.isoformat()} is in the future"
    if at < facts.now - USAGE_LATE_LIMIT:
        return f"started_at {at.isoformat()} is older than {USAGE_LATE_LIMIT.days} days"
    if record.model not in facts.models:
        return f"unknown model {record.model!r}"
    if record.tenant:
        policy = facts.tenants.get(record.tenant)
        if policy is None:
            return f"unknown tenant {record.tenant!r}"
        if not region_allowed(policy, sender.region, facts.jurisdiction):
            return f"region {sender.region!r} may not serve tenant {record.tenant!r}"
    return None
