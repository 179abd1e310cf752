"""Published routing tables: every compiled document of every region, by version."""

from __future__ import annotations

from django.db import models

from federation.inventory.models import Edge, Region


class RoutingTableCounter(models.Model):
    """The last version handed out for a region, locked while a compiler publishes.

    Keyed by region code, not by foreign key: a region deleted and created again keeps
    counting up, so edges that still hold the old numbers accept the new tables.
    """

    region_code = models.CharField(max_length=63, unique=True)
    last_version = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.region_code}@{self.last_version}"


class RoutingTableVersion(models.Model):
    """One compiled table document (unsigned; signed when served, with the current key)."""

    region = models.ForeignKey(Region, on_delete=models.CASCADE, related_name="routing_tables")
    version = models.PositiveBigIntegerField()
    document = models.JSONField()
    body_hash = models.CharField(
        max_length=64,
        help_text="SHA-256 of the document without version, generated_at and signature: "
        "an unchanged fleet compiles to the same hash and publishes nothing.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["region__code", "-version"]
        constraints = [
            models.UniqueConstraint(fields=["region", "version"], name="routingtable_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.region.code}@{self.version}"


class BudgetReport(models.Model):
    """What an edge (one of its worker processes: a holder) last reported having committed of
    the budgets it holds leases of, and under which table version: the control plane lowers an
    unused ceiling only from a report taken on the table that granted it
    (``docs/adr/0008-budget-leases.md``)."""

    edge = models.ForeignKey(Edge, on_delete=models.CASCADE, related_name="budget_reports")
    #: The edge's name for its worker 0, ``<name>.<i>`` for its others (``lease_holder``).
    holder = models.CharField(max_length=70, unique=True)
    table_version = models.PositiveBigIntegerField()
    #: ``{tenant: {key prefix or "": pico-USD}}``; a budget left out committed its count.
    committed = models.JSONField(default=dict)
    reported_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.holder}@{self.table_version}"
