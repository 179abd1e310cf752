"""The demo's usage history on the demo fleet: every tenant served only where its residency
allows, and for every pool and hour, what the usage carries plus what stays unallocated is the
pool's cost, exactly — and the usage groups' costs add up to what was allocated."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command

from federation.demo.usage import load_usage_history
from federation.inventory.models import Deployment
from federation.metering.models import PoolHour, UsageHour, UsageRecord
from tests.integration.inventory_factories import make_instance

NOW = datetime(2026, 11, 30, 12, 30, tzinfo=UTC)


@pytest.mark.django_db
def test_demo_history_reconciles_every_pool_hour_exactly() -> None:
    call_command("loaddemo", stdout=StringIO())
    for n, dep in enumerate(Deployment.objects.select_related("pool__region").order_by("pk")):
        make_instance(dep, f"demo-{dep.pool.region.code}-{n}", "ready")
    records = load_usage_history(days=2, now=NOW)
    assert records > 500
    assert UsageRecord.objects.count() == records
    assert set(UsageRecord.objects.filter(tenant="globex-eu").values_list("region", flat=True)) == {
        "eu-west"
    }
    assert set(UsageRecord.objects.filter(tenant="initech").values_list("region", flat=True)) == {
        "us-east",
        "eu-west",
        "ap-southeast",
    }
    carried: dict[tuple[datetime, str], Decimal] = defaultdict(Decimal)
    for row in UsageHour.objects.all():
        carried[(row.hour, row.pool)] += row.cost_usd
    pool_hours = list(PoolHour.objects.all())
    assert len(pool_hours) == 48 * 6  # every hour of two days, for each of the six pools
    for ph in pool_hours:
        assert ph.allocated_usd + ph.idle_usd + ph.warm_idle_usd == ph.cost_usd
        assert ph.allocated_usd == carried.get((ph.hour, ph.pool), Decimal(0))
    assert sum(ph.allocated_usd for ph in pool_hours) > 0
    total_price = sum((r.price_usd for r in UsageHour.objects.all()), start=Decimal(0))
    assert total_price == sum((r.price_usd for r in UsageRecord.objects.all()), start=Decimal(0))
