"""Usage as the edges recorded it, the prices it is charged at, and hourly rollups.

``UsageRecord`` is a fact table: one row per served request, written once by ingestion (keyed
by ``(started_at, request_id)``, so a record shipped twice is stored once) and never updated.
Its dimensions are stored as the edge named them (tenant slug, model, region, instance) plus the
pool the instance belonged to at ingestion, so history keeps its meaning when the inventory
changes. On PostgreSQL the table is partitioned by month (``migrations/metering/0001``), so a
month of records is one partition to scan, detach or drop.
"""

from __future__ import annotations

from typing import Literal

from django.db import models

from federation.core.models import TimeStampedModel
from federation.inventory.models import LanguageModel
from federation.tenancy.models import Tenant


class ModelPrice(TimeStampedModel):
    """USD per million tokens of a model from ``effective_from`` on; a row with a tenant
    overrides the list price for that tenant."""

    model = models.ForeignKey(LanguageModel, on_delete=models.CASCADE, related_name="prices")
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="prices"
    )
    input_per_mtok = models.DecimalField(max_digits=14, decimal_places=6)
    cached_input_per_mtok = models.DecimalField(max_digits=14, decimal_places=6)
    output_per_mtok = models.DecimalField(max_digits=14, decimal_places=6)
    effective_from = models.DateTimeField()

    class Meta:
        ordering = ["model", "tenant", "-effective_from"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "tenant", "effective_from"], name="uniq_model_price_from"
            ),
            models.UniqueConstraint(
                fields=["model", "effective_from"],
                condition=models.Q(tenant__isnull=True),
                name="uniq_list_price_from",
            ),
        ]

    def __str__(self) -> str:
        who = self.tenant_id or "list"
        return f"{self.model_id} ({who}) from {self.effective_from:%Y-%m-%d}"


class UsageRecord(models.Model):
    """One served request (``regions/tables/usage.py``), priced at ingestion."""

    pk = models.CompositePrimaryKey("started_at", "request_id")
    started_at = models.DateTimeField()
    request_id = models.CharField(max_length=64)
    tenant = models.CharField(max_length=63, blank=True)
    key_prefix = models.CharField(max_length=32, blank=True)
    model = models.CharField(max_length=128)
    adapter = models.CharField(max_length=128, blank=True)
    region = models.CharField(max_length=63)
    entry_region = models.CharField(max_length=63)
    instance = models.CharField(max_length=63)
    #: ``<region>/<pool>`` of the instance at ingestion ("" if it is no longer known).
    pool = models.CharField(max_length=130, blank=True)
    prompt_tokens = models.PositiveIntegerField()
    cached_tokens = models.PositiveIntegerField()
    completion_tokens = models.PositiveIntegerField()
    ttft_ms = models.FloatField(null=True)
    duration_ms = models.FloatField()
    status = models.PositiveSmallIntegerField()
    streamed = models.BooleanField()
    cancelled = models.BooleanField()
    usage_reported = models.BooleanField()
    #: Exact: per-token prices have 6 decimals, so a price has at most 12.
    price_usd = models.DecimalField(max_digits=24, decimal_places=12)
    #: The edge that served it ("" when it had no name), whose budget lease it counts against.
    edge = models.CharField(max_length=63, blank=True, default="")
    #: A stream continued on another instance after its engine was lost (issue 31): how many
    #: times (0: one engine served it), every engine that served part of it in order
    #: (``region/instance,…``; "" when not continued), why the first continuation happened
    #: ("" when not continued), and the prompt tokens the engines processed again to continue —
    #: the operator's cost (``cost.py``), never in ``price_usd``. Database defaults too, so
    #: rows written by SQL without them (benchmarks, a restore) stay valid.
    continued = models.PositiveSmallIntegerField(default=0, db_default=0)
    legs = models.CharField(max_length=1024, blank=True, default="", db_default="")
    continuation_reason = models.CharField(max_length=64, blank=True, default="", db_default="")
    reprefill_tokens = models.PositiveIntegerField(default=0, db_default=0)

    class Meta:
        indexes = [models.Index(fields=["tenant", "started_at"], name="usage_tenant_time")]

    def __str__(self) -> str:
        return f"{self.request_id} ({self.tenant or '-'}, {self.model})"


#: What a rollup sums over its records (``UsageHour``, ``UsageDay``), in its fields' names.
USAGE_SUMS = (
    "requests",
    "cancelled",
    "errors",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "price_usd",
    "cost_usd",
)
Dimension = Literal["tenant", "model", "region", "pool"]
DIMENSIONS: tuple[Dimension, ...] = ("tenant", "model", "region", "pool")


class UsageSums(models.Model):
    """The dimensions and sums a rollup row shares with the others."""

    tenant = models.CharField(max_length=63, blank=True)
    model = models.CharField(max_length=128)
    region = models.CharField(max_length=63)
    pool = models.CharField(max_length=130, blank=True)
    requests = models.PositiveIntegerField()
    cancelled = models.PositiveIntegerField()
    errors = models.PositiveIntegerField()
    prompt_tokens = models.PositiveBigIntegerField()
    cached_tokens = models.PositiveBigIntegerField()
    completion_tokens = models.PositiveBigIntegerField()
    #: Exact: per-token prices have 6 decimals, so a price has at most 12.
    price_usd = models.DecimalField(max_digits=24, decimal_places=12)
    #: Its share of its pool's cost (``federation/metering/cost.py``).
    cost_usd = models.DecimalField(max_digits=24, decimal_places=12)

    class Meta:
        abstract = True


class UsageHour(UsageSums):
    """Usage summed per hour x tenant x model x region x pool (what reports read)."""

    hour = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["hour", "tenant", "model", "region", "pool"], name="uniq_usage_hour"
            )
        ]
        indexes = [models.Index(fields=["tenant", "hour"], name="usage_hour_tenant")]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}h {self.tenant or '-'} {self.model}"


class UsageDay(UsageSums):
    """``UsageHour`` summed per UTC day, kept with its hours: month reports read 30 rows per
    group instead of 720."""

    day = models.DateField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["day", "tenant", "model", "region", "pool"], name="uniq_usage_day"
            )
        ]
        indexes = [models.Index(fields=["tenant", "day"], name="usage_day_tenant")]

    def __str__(self) -> str:
        return f"{self.day:%Y-%m-%d} {self.tenant or '-'} {self.model}"


class PoolHour(models.Model):
    """A GPU pool's cost in one hour and where it went: ``allocated`` to usage (the sum of its
    ``UsageHour.cost_usd``), or unallocated as ``idle`` GPUs, ``warm_idle`` instances and the
    ``reprefill`` work of continued streams (the operator's) — the four add up to ``cost``
    exactly."""

    hour = models.DateTimeField()
    #: ``<region>/<pool>``, as in ``UsageRecord.pool``.
    pool = models.CharField(max_length=130)
    gpus = models.PositiveIntegerField()
    cost_usd = models.DecimalField(max_digits=24, decimal_places=12)
    allocated_usd = models.DecimalField(max_digits=24, decimal_places=12)
    idle_usd = models.DecimalField(max_digits=24, decimal_places=12)
    warm_idle_usd = models.DecimalField(max_digits=24, decimal_places=12)
    #: The engine time the hour's continued streams spent processing their prompt and relayed
    #: text again (``UsageRecord.reprefill_tokens``): the operator's, carried by no tenant.
    reprefill_usd = models.DecimalField(max_digits=24, decimal_places=12, default=0, db_default=0)
    busy_s = models.FloatField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["hour", "pool"], name="uniq_pool_hour")]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}h {self.pool}"


class CountedSpend(models.Model):
    """A month's spend as ingestion counted it, by tenant, key and the edge that served it.

    Added to in the transaction that stores the records (only those not stored before), so it
    is current the moment a batch commits and exact on PostgreSQL: what budgets are checked
    against and each edge's lease is measured from (``docs/adr/0008-budget-leases.md``).
    """

    month = models.DateField(help_text="The first day of the UTC month.")
    tenant = models.CharField(max_length=63)
    key_prefix = models.CharField(max_length=32, blank=True)
    edge = models.CharField(max_length=63, blank=True)
    price_usd = models.DecimalField(max_digits=24, decimal_places=12)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["month", "tenant", "key_prefix", "edge"], name="uniq_counted_spend"
            )
        ]

    def __str__(self) -> str:
        return f"{self.month:%Y-%m} {self.tenant} {self.key_prefix or '*'} @{self.edge or '-'}"


class StaleUsageHour(models.Model):
    """An hour whose records changed since its rollup was computed. Each ingestion renews
    ``mark``; the rollup task recomputes the hour and removes the row only if the mark is
    still the one it read, so records that arrive meanwhile get their own recompute."""

    hour = models.DateTimeField(primary_key=True)
    mark = models.UUIDField()
    marked_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}h"


class FleetHour(models.Model):
    """The cost facts of one ended hour — each pool's GPUs and price, each instance's pool,
    GPUs and speeds — frozen when the hour is first rolled up after it ended. A later recompute
    (a late record, a replayed spool) prices the hour as the fleet stood then, not as it is
    today: a price change or a removed instance does not rewrite last month's costs."""

    hour = models.DateTimeField(unique=True)
    taken_at = models.DateTimeField()
    #: ``[{"pool": "<region>/<pool>", "gpus": n, "price_per_gpu_hour": "<decimal>"}]``
    pools = models.JSONField()
    #: ``[{"instance", "pool", "gpus", "prefill_tokens_per_s", "decode_tokens_per_s"}]``
    instances = models.JSONField()

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}h fleet"


class UsageDeadLetter(models.Model):
    """A usage document refused at ingestion, with why, for an operator to list and replay
    (``services.usage_dead_letter_replay``).

    Per-record refusals keep the one record; a stream entry that is not authenticated (unknown
    edge, bad MAC) is kept whole with its MAC, so a replay checks the MAC again. Bounded:
    a document is cut at :data:`DEAD_LETTER_DOCUMENT_MAX` bytes (a cut one is listed, never
    replayed) and only the newest :data:`DEAD_LETTER_MAX_ROWS` rows are kept
    (``services.usage_dead_letters_add`` deletes the oldest and counts them).
    """

    class Source(models.TextChoices):
        STREAM = "stream", "Redis usage stream"
        HTTP = "http", "HTTP usage endpoint"

    received_at = models.DateTimeField(db_index=True)
    source = models.CharField(max_length=8, choices=Source.choices)
    #: The edge that sent it: authenticated, or only claimed when ``authenticated`` is false.
    edge = models.CharField(max_length=63, blank=True)
    region = models.CharField(max_length=63, blank=True)
    authenticated = models.BooleanField(default=True)
    #: The stream entry's MAC (hex) when it was not authenticated ("" otherwise).
    mac = models.CharField(max_length=64, blank=True)
    document = models.BinaryField()
    truncated = models.BooleanField(default=False)
    reason = models.CharField(max_length=300)
    #: SHA-256 of source, edge and document: the same refusal received twice is kept once.
    fingerprint = models.CharField(max_length=64, unique=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.received_at:%Y-%m-%d %H:%M} {self.source} {self.edge or '-'}: {self.reason}"


#: The most bytes of a document a dead letter keeps, and the most rows kept.
DEAD_LETTER_DOCUMENT_MAX = 32 * 1024
DEAD_LETTER_MAX_ROWS = 10_000
