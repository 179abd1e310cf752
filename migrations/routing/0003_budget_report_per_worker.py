"""Budget reports per holder (an edge's worker process) instead of per edge.

The reports are transient (each heartbeat replaces its holder's), so the table is recreated
rather than converted: until the edges' next heartbeats, a few seconds, the compiler treats
their leases as unreported and lowers no ceiling — the safe side."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0012_edge_workers"),
        ("routing", "0002_budget_report"),
    ]

    operations = [
        migrations.DeleteModel(name="BudgetReport"),
        migrations.CreateModel(
            name="BudgetReport",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "edge",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="budget_reports",
                        to="inventory.edge",
                    ),
                ),
                ("holder", models.CharField(max_length=70, unique=True)),
                ("table_version", models.PositiveBigIntegerField()),
                ("committed", models.JSONField(default=dict)),
                ("reported_at", models.DateTimeField()),
            ],
        ),
    ]
