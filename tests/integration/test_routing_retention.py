"""Retention of published table versions on the real PostgreSQL: each version holds the whole
table (every tenant), and a fleet with budgets publishes one every few seconds, so the old
ones are pruned — but never a region's newest, a recent one, or one an edge still serves."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from federation.inventory.models import Edge, Region
from federation.routing import services
from federation.routing.models import RoutingTableVersion
from tests.integration.inventory_factories import make_region
from workers.tasks import routing_tables_prune_task


def versions(region: Region, count: int, *, hours_old: float) -> None:
    """``count`` more versions of ``region``, created ``hours_old`` hours ago."""
    start = RoutingTableVersion.objects.filter(region=region).count()
    for v in range(start + 1, start + count + 1):
        row = RoutingTableVersion.objects.create(
            region=region, version=v, document={"version": v}, body_hash=f"{v:064x}"
        )
        RoutingTableVersion.objects.filter(pk=row.pk).update(
            created_at=timezone.now() - timedelta(hours=hours_old)
        )


def kept(region: Region) -> list[int]:
    return sorted(
        RoutingTableVersion.objects.filter(region=region).values_list("version", flat=True)
    )


@pytest.mark.django_db
def test_old_versions_beyond_the_newest_go_unless_recent_or_applied() -> None:
    eu, us = make_region("eu-west", "EU"), make_region("us-east", "US")
    versions(eu, 8, hours_old=48)  # 1-8: old
    versions(eu, 2, hours_old=0)  # 9-10: recent
    versions(us, 3, hours_old=48)  # 1-3: old, and only three of them
    Edge.objects.create(region=eu, name="edge-eu", url="http://eu.edge", applied_table_version=2)
    # An edge of another region applying version 4 keeps nothing here.
    Edge.objects.create(region=us, name="edge-us", url="http://us.edge", applied_table_version=4)

    deleted = services.routing_tables_prune(
        keep=3, older_than=timezone.now() - timedelta(hours=24), batch=2
    )
    # eu: the newest three (8-10), the recent two (9, 10) among them, and 2 (applied) stay.
    assert kept(eu) == [2, 8, 9, 10]
    assert kept(us) == [1, 2, 3]  # none beyond its newest three
    assert deleted == 6
    assert services.routing_tables_prune(keep=3, older_than=timezone.now()) == 0
    with pytest.raises(ValueError, match="newest"):
        services.routing_tables_prune(keep=0, older_than=timezone.now())


@pytest.mark.django_db
def test_the_periodic_task_prunes_with_the_configured_retention(settings: Any) -> None:
    region = make_region("eu-west", "EU")
    versions(region, 6, hours_old=30)
    versions(region, 1, hours_old=1)
    settings.FEDINFER_TABLE_VERSIONS_KEPT = 2
    settings.FEDINFER_TABLE_RETENTION_HOURS = 24
    assert routing_tables_prune_task.apply().get() == 5
    assert kept(region) == [6, 7]
    settings.FEDINFER_TABLE_RETENTION_HOURS = 48  # nothing is that old any more
    versions(region, 3, hours_old=30)
    assert routing_tables_prune_task.apply().get() == 0
    assert "routing-tables-prune" in settings.CELERY_BEAT_SCHEDULE
