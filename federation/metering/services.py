"""Writes for metering: prices, usage records from the edges, and the dead-letter of those refused.

Ingestion is idempotent: a record is keyed by ``(started_at, request_id)``, both set by the edge
that served it, so the same record shipped twice (an edge restarted before its batch was
acknowledged, a worker killed after the commit but before it acknowledged the stream) is stored
once. The hourly rollups are ``rollups.py``'s.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from federation.core.audit import Actor, audit_record
from federation.inventory.models import Edge, Instance, InstanceInterval, LanguageModel, Region
from federation.metering import partitions
from federation.metering.admission import (
    MAX_PRICE_USD,
    SenderFacts,
    UsageFault,
    UsageSender,
    column_fault,
    sender_fault,
    storable_time,
)
from federation.metering.cost import ZERO
from federation.metering.metrics import DEAD_LETTERS_EVICTED
from federation.metering.models import (
    DEAD_LETTER_DOCUMENT_MAX,
    DEAD_LETTER_MAX_ROWS,
    CountedSpend,
    ModelPrice,
    UsageDeadLetter,
    UsageRecord,
)
from federation.metering.pricing import FREE, PRICE_DECIMALS, Price, request_price
from federation.metering.rollups import usage_hours_mark_stale
from federation.tenancy.models import Tenant
from federation.tenancy.residency import ResidencyPolicy
from regions.tables.usage import UsageRecord as UsageDocument
from regions.tables.usage import UsageRecordError, decode_record, usage_batch_verify

log = logging.getLogger("fedinfer.metering")


@dataclass(frozen=True, slots=True)
class Refusal:
    """A document of a batch that was not stored: its place in the batch, itself, and why."""

    index: int
    document: bytes
    reason: str


@dataclass(slots=True)
class IngestResult:
    #: Records in the batch that passed the checks (stored now, or already stored before).
    accepted: int = 0
    #: Documents refused, with why: kept in the dead-letter by :func:`usage_ingest` when it is
    #: given a ``source``, never retried.
    rejected: list[Refusal] = field(default_factory=list)
    #: Some record was of a tenant with a budget: the caller re-leases budgets to the edges.
    budgeted: bool = False


@dataclass(frozen=True, slots=True)
class DeadLetterIn:
    """A refused document to keep (:func:`usage_dead_letters_add`)."""

    source: str
    edge: str
    region: str
    document: bytes
    reason: str
    authenticated: bool = True
    mac: str = ""


class PriceBook:
    """Every price row of the models in a batch, so each record is priced without a query."""

    def __init__(self, models: Iterable[str]) -> None:
        rows = ModelPrice.objects.filter(model__name__in=set(models)).select_related(
            "model", "tenant"
        )
        self._rows: dict[tuple[str, str], list[tuple[datetime, Price]]] = {}
        for row in rows.order_by("-effective_from"):
            key = (row.model.name, row.tenant.slug if row.tenant else "")
            price = Price(row.input_per_mtok, row.cached_input_per_mtok, row.output_per_mtok)
            self._rows.setdefault(key, []).append((row.effective_from, price))

    def price(self, model: str, tenant: str, at: datetime) -> Price:
        """The tenant's own price in effect at ``at``, else the list price, else free."""
        for key in ((model, tenant), (model, "")):
            for since, price in self._rows.get(key, ()):
                if since <= at:
                    return price
        return FREE


@transaction.atomic
def model_price_set(
    *,
    actor: Actor,
    model: LanguageModel,
    price: Price,
    effective_from: datetime,
    tenant: Tenant | None = None,
) -> ModelPrice:
    """Price ``model`` from ``effective_from`` on, for everyone or one ``tenant``.

    Records already ingested keep the price they were charged; a price set for a moment in the
    past applies to records ingested from now on.
    """
    amounts = {
        "input_per_mtok": price.input_per_mtok,
        "cached_input_per_mtok": price.cached_input_per_mtok,
        "output_per_mtok": price.output_per_mtok,
    }
    errors = {
        name: [f"must be >= 0 with at most {PRICE_DECIMALS} decimals"]
        for name, value in amounts.items()
        if not value.is_finite() or value < 0 or value != round(value, PRICE_DECIMALS)
    }
    if errors:
        raise ValidationError(errors)
    row, created = ModelPrice.objects.update_or_create(
        model=model, tenant=tenant, effective_from=effective_from, defaults=amounts
    )
    audit_record(
        actor=actor,
        action="model_price.set",
        obj=row,
        changes={"created": created, **{k: str(v) for k, v in amounts.items()}},
    )
    return row


def usage_ingest(
    *,
    documents: Sequence[bytes],
    sender: UsageSender | None = None,
    source: str | None = None,
    now: datetime | None = None,
) -> IngestResult:
    """Store, priced, every record in ``documents`` that passes the checks and is not stored
    yet; mark their hours stale.

    Every document is checked alone (``admission.py``) and one that fails is refused alone, so
    it cannot hold up its batch or the stream: records that do not decode, convert or fit their
    columns always; with a ``sender`` (an authenticated edge), also records of another region
    or edge, of a tenant its region may not serve, of an unknown model, or outside the time
    window. With a ``source`` the refused ones go to the dead-letter in the same transaction
    as the stored ones. Callers without a ``sender`` are the control plane's own (the demo's
    history, benchmarks).
    """
    result = IngestResult()
    decoded: list[tuple[int, UsageDocument, datetime]] = []
    for index, document in enumerate(documents):
        try:
            record = decode_record(document)
            at = storable_time(record)
        except (UsageRecordError, UsageFault) as exc:
            result.rejected.append(Refusal(index, document, str(exc)))
            continue
        fault = column_fault(record)
        if fault is not None:
            result.rejected.append(Refusal(index, document, fault))
            continue
        decoded.append((index, record, at))
    if sender is not None and decoded:
        facts = _sender_facts(sender, [r for _, r, _ in decoded], now or timezone.now())
        kept = []
        for index, record, at in decoded:
            fault = sender_fault(record, at, sender, facts)
            if fault is None:
                kept.append((index, record, at))
            else:
                result.rejected.append(Refusal(index, documents[index], fault))
        decoded = kept
    rows: list[Row] = []
    stored: list[tuple[UsageDocument, datetime]] = []
    if decoded:
        pools = _pools_of({r.instance for _, r, _ in decoded})
        prices = PriceBook(r.model for _, r, _ in decoded)
        for index, record, at in decoded:
            row = _row(record, at, pools.get(record.instance, ""), prices)
            if not -MAX_PRICE_USD < row[COLUMNS.index("price_usd")] < MAX_PRICE_USD:
                result.rejected.append(Refusal(index, documents[index], "price overflows"))
                continue
            rows.append(row)
            stored.append((record, at))
    result.rejected.sort(key=lambda refusal: refusal.index)
    with transaction.atomic():
        if rows:
            partitions.ensure_months({(at.year, at.month) for _, at in stored})
            _insert(rows)
            usage_hours_mark_stale(at for _, at in stored)
        if source is not None and result.rejected:
            usage_dead_letters_add(
                letters=[
                    DeadLetterIn(
                        source=source,
                        edge=sender.edge if sender else "",
                        region=sender.region if sender else "",
                        document=refusal.document,
                        reason=refusal.reason,
                    )
                    for refusal in result.rejected
                ]
            )
    result.accepted = len(rows)
    tenants = {r.tenant for r, _ in stored if r.tenant}
    result.budgeted = bool(tenants) and (
        Tenant.objects.filter(slug__in=tenants)
        .filter(Q(monthly_budget_usd__isnull=False) | Q(api_keys__monthly_budget_usd__isnull=False))
        .exists()
    )
    return result


def _sender_facts(sender: UsageSender, records: list[UsageDocument], now: datetime) -> SenderFacts:
    """The tenants, models and region facts the batch's checks need (three queries)."""
    slugs = {r.tenant for r in records if r.tenant}
    tenants = {
        t.slug: ResidencyPolicy.of(
            t.allowed_jurisdictions, (r.code for r in t.allowed_regions.all())
        )
        for t in Tenant.objects.filter(slug__in=slugs).prefetch_related("allowed_regions")
    }
    models = LanguageModel.objects.filter(name__in={r.model for r in records})
    jurisdiction = Region.objects.filter(code=sender.region).values_list("jurisdiction", flat=True)
    return SenderFacts(
        now=now,
        jurisdiction=jurisdiction.first() or "",
        tenants=tenants,
        models=frozenset(models.values_list("name", flat=True)),
    )


def usage_dead_letters_add(*, letters: Sequence[DeadLetterIn], now: datetime | None = None) -> int:
    """Keep refused documents for an operator (each once however often it arrives), then
    delete the oldest rows beyond :data:`DEAD_LETTER_MAX_ROWS`; the number deleted."""
    received_at = now or timezone.now()
    rows = []
    for letter in letters:
        identity = f"{letter.source}\n{letter.edge}\n{letter.mac}\n".encode()
        rows.append(
            UsageDeadLetter(
                received_at=received_at,
                source=letter.source,
                edge=letter.edge[:63],
                region=letter.region[:63],
                authenticated=letter.authenticated,
                mac=letter.mac[:64],
                document=letter.document[:DEAD_LETTER_DOCUMENT_MAX],
                truncated=len(letter.document) > DEAD_LETTER_DOCUMENT_MAX,
                reason=letter.reason[:300],
                fingerprint=hashlib.sha256(identity + letter.document).hexdigest(),
            )
        )
    with transaction.atomic():
        UsageDeadLetter.objects.bulk_create(rows, ignore_conflicts=True)
        oldest_kept = (
            UsageDeadLetter.objects.order_by("-id")
            .values_list("id", flat=True)[DEAD_LETTER_MAX_ROWS - 1 : DEAD_LETTER_MAX_ROWS]
            .first()
        )
        evicted = 0
        if oldest_kept is not None:
            evicted, _ = UsageDeadLetter.objects.filter(id__lt=oldest_kept).delete()
    if evicted:
        DEAD_LETTERS_EVICTED.inc(evicted)
        log.error("usage dead-letter full: %d oldest rows deleted", evicted)
    return evicted


@dataclass(frozen=True, slots=True)
class ReplayResult:
    accepted: int
    #: Why the rest is still refused (empty: the dead letter was removed).
    refused: list[str]


def usage_dead_letter_replay(*, actor: Actor, letter: UsageDeadLetter) -> ReplayResult:
    """Run a dead letter through ingestion's checks again as the edge that sent it (a stream
    entry's MAC checked again first); store what passes now, remove the letter when all of it
    did, else keep it with the new reasons. Idempotent: records are stored once by their key.
    Audited (the audit event also recompiles the routing tables, which re-reads spend)."""
    with transaction.atomic():
        letter = UsageDeadLetter.objects.select_for_update().get(pk=letter.pk)
        sender, documents, refused = _replay_input(letter)
        accepted = 0
        if sender is not None:
            result = usage_ingest(documents=documents, sender=sender)
            accepted = result.accepted
            refused = [refusal.reason for refusal in result.rejected]
        audit_record(
            actor=actor,
            action="usage_dead_letter.replay",
            obj=letter,
            changes={"accepted": accepted, "refused": refused[:10]},
        )
        if refused:
            letter.reason = "; ".join(refused)[:300]
            letter.save(update_fields=["reason"])
        else:
            letter.delete()
    return ReplayResult(accepted=accepted, refused=refused)


def _replay_input(letter: UsageDeadLetter) -> tuple[UsageSender | None, list[bytes], list[str]]:
    """Who the letter is replayed as, its documents, or why it cannot be replayed."""
    document = bytes(letter.document)
    if letter.truncated:
        return None, [], [f"cut at {DEAD_LETTER_DOCUMENT_MAX} bytes: not replayable"]
    if letter.authenticated:
        if not letter.edge or not letter.region:
            return None, [], ["no sender: not replayable"]
        return UsageSender(letter.edge, letter.region), [document], []
    edge = Edge.objects.select_related("region").filter(name=letter.edge).first()
    if edge is None or not edge.credential_hash or not letter.mac:
        return None, [], ["bad mac"]
    key = edge.credential_hash.encode("ascii")
    try:
        mac = bytes.fromhex(letter.mac)
    except ValueError:
        return None, [], ["bad mac"]
    if not usage_batch_verify(key, edge.name, document, mac):
        return None, [], ["bad mac"]
    lines = [line for line in document.split(b"\n") if line]
    return UsageSender(edge.name, edge.region.code), lines, []


#: Columns of a usage row, in the order :func:`_row` builds them.
COLUMNS = (
    "started_at",
    "request_id",
    "tenant",
    "key_prefix",
    "model",
    "adapter",
    "region",
    "entry_region",
    "instance",
    "pool",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "ttft_ms",
    "duration_ms",
    "status",
    "streamed",
    "cancelled",
    "usage_reported",
    "price_usd",
    "edge",
    "continued",
    "legs",
    "continuation_reason",
    "reprefill_tokens",
)
Row = tuple[Any, ...]


def _row(record: UsageDocument, at: datetime, pool: str, prices: PriceBook) -> Row:
    """The record's columns, priced on what the tenant is billed — prompt, cached and
    completion tokens — never on ``reprefill_tokens`` (a continued stream's work done again:
    the operator's cost, ``cost.py``)."""
    price = prices.price(record.model, record.tenant or "", at)
    return (
        at,
        record.request_id,
        record.tenant or "",
        record.key_prefix or "",
        record.model,
        record.adapter or "",
        record.region,
        record.entry_region,
        record.instance,
        pool,
        record.prompt_tokens,
        record.cached_tokens,
        record.completion_tokens,
        record.ttft_ms,
        record.duration_ms,
        record.status,
        record.streamed,
        record.cancelled,
        record.usage_reported,
        request_price(
            price,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            completion_tokens=record.completion_tokens,
        ),
        record.edge or "",
        record.continued,
        record.legs or "",
        record.continuation_reason or "",
        record.reprefill_tokens,
    )


def _insert(rows: list[Row]) -> None:
    """Insert the rows not stored yet and count their price (:class:`CountedSpend`).

    PostgreSQL: COPY into a temporary table, then one ``INSERT ... ON CONFLICT DO NOTHING``
    whose returned rows are summed into the counted spend by the same statement (several
    times faster than row inserts). Other databases (the demo's SQLite): row by row.
    """
    table = UsageRecord._meta.db_table
    columns = ", ".join(COLUMNS)
    with connection.cursor() as cursor:
        if connection.vendor != "postgresql":
            _insert_rows(cursor, table, columns, rows)
            return
        cursor.execute(
            f"CREATE TEMPORARY TABLE usage_in (LIKE {table} INCLUDING DEFAULTS) ON COMMIT DROP"
        )
        with cursor.cursor.copy(f"COPY usage_in ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        counted = CountedSpend._meta.db_table
        # Rows in a fixed order, so concurrent ingestions lock counted rows in the same order.
        cursor.execute(
            f"WITH stored AS (INSERT INTO {table} ({columns}) SELECT {columns} FROM usage_in "
            "ON CONFLICT DO NOTHING RETURNING started_at, tenant, key_prefix, edge, price_usd) "
            f"INSERT INTO {counted} (month, tenant, key_prefix, edge, price_usd) "
            "SELECT (date_trunc('month', started_at AT TIME ZONE 'UTC'))::date AS m, tenant, "
            "key_prefix, edge, sum(price_usd) FROM stored WHERE tenant <> '' "
            "GROUP BY m, tenant, key_prefix, edge ORDER BY m, tenant, key_prefix, edge "
            "ON CONFLICT (month, tenant, key_prefix, edge) "
            f"DO UPDATE SET price_usd = {counted}.price_usd + EXCLUDED.price_usd"
        )
        cursor.execute("DROP TABLE usage_in")  # now, not at commit: the batch may be nested


def _insert_rows(cursor: Any, table: str, columns: str, rows: list[Row]) -> None:
    marks = ", ".join(["%s"] * len(COLUMNS))
    spent: dict[tuple[date, str, str, str], Decimal] = {}
    at, tenant, key, price, edge = (
        COLUMNS.index(c) for c in ("started_at", "tenant", "key_prefix", "price_usd", "edge")
    )
    for row in rows:
        cursor.execute(
            f"INSERT INTO {table} ({columns}) VALUES ({marks}) ON CONFLICT DO NOTHING", row
        )
        if cursor.rowcount == 1 and row[tenant]:
            group = (
                row[at].astimezone(UTC).date().replace(day=1),
                row[tenant],
                row[key],
                row[edge],
            )
            spent[group] = spent.get(group, ZERO) + row[price]
    counted = CountedSpend._meta.db_table
    for (month, slug, prefix, name), usd in sorted(spent.items()):
        cursor.execute(
            f"INSERT INTO {counted} (month, tenant, key_prefix, edge, price_usd) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (month, tenant, key_prefix, edge) "
            f"DO UPDATE SET price_usd = {counted}.price_usd + EXCLUDED.price_usd",
            (month, slug, prefix, name, usd),
        )


def _pools_of(instances: set[str]) -> dict[str, str]:
    """Instance name -> ``<region>/<pool>``: of the instances that still exist, else of the
    last GPU interval of those deleted since (their records may arrive late)."""
    rows = Instance.objects.filter(name__in=instances).values_list(
        "name", "deployment__pool__region__code", "deployment__pool__name"
    )
    pools = {name: f"{region}/{pool}" for name, region, pool in rows}
    gone = instances - set(pools)
    if gone:
        last = InstanceInterval.objects.filter(name__in=gone).order_by("started_at", "id")
        pools.update(last.values_list("name", "pool"))
    return pools
