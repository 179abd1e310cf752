"""Pool revisions: a pool resized, repriced, created or deleted within an hour costs each part
of the hour at what it had then, and an hour once frozen keeps those facts (real PostgreSQL).

Before revisions, an hour was costed with the pools as they stood at its first rollup: a pool
halved and repriced mid-hour was costed at its new size and price for the whole hour."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from federation.inventory.models import GPUPool, Instance, PoolRevision
from federation.inventory.services import pool_delete, pool_update
from federation.metering.models import FleetHour, PoolHour
from federation.metering.rollups import usage_hours_refresh
from federation.metering.services import usage_ingest
from federation.tenancy.models import Tenant
from regions.tables.usage import UsageRecord as Doc
from regions.tables.usage import encode_record
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
    services_clock,
)

pytestmark = pytest.mark.django_db

HOUR = datetime(2026, 11, 30, 14, 0, tzinfo=UTC)


def record(i: int, at: datetime) -> bytes:
    return encode_record(
        Doc(
            request_id=f"req-{i}",
            started_at=at.timestamp(),
            region="us-east",
            entry_region="us-east",
            instance="b",
            model=Instance.objects.get(name="b").deployment.model.name,
            tenant="acme",
            prompt_tokens=1_000,
            completion_tokens=100,
            ttft_ms=10.0,
            duration_ms=100.0,
        )
    )


def costs(hour: datetime) -> dict[str, tuple[Decimal, Decimal]]:
    """pool -> (cost, allocated), checking allocated + unallocated == cost exactly."""
    out = {}
    for row in PoolHour.objects.filter(hour=hour):
        assert row.allocated_usd + row.idle_usd + row.warm_idle_usd == row.cost_usd
        out[row.pool] = (row.cost_usd, row.allocated_usd)
    return out


def test_each_part_of_the_hour_is_costed_at_the_pool_it_had_then() -> None:
    region = make_region("us-east")
    Tenant.objects.create(slug="acme", name="Acme")
    with services_clock(HOUR - timedelta(days=1)):
        h100 = make_pool(region, "h100")  # 16 GPUs at $2.50
        l4 = make_pool(region, "l4", accelerator="L4-24G", gpus_per_node=4, node_count=1,
                       interconnect="pcie", price_per_gpu_hour=Decimal("0.60"))  # fmt: skip
        make_instance(make_deployment(make_model(), h100), "b", state="ready")  # 1 GPU
    with services_clock(HOUR + timedelta(minutes=20)):
        pool_delete(actor=None, pool=l4)
    with services_clock(HOUR + timedelta(minutes=30)):  # halved and repriced
        pool_update(
            actor=None,
            pool=GPUPool.objects.get(name="h100"),
            data={"node_count": 1, "price_per_gpu_hour": Decimal("4.00")},
        )
    with services_clock(HOUR + timedelta(minutes=45)):
        make_pool(region, "a100", accelerator="A100-80G", gpus_per_node=4, node_count=1,
                  interconnect="pcie", price_per_gpu_hour=Decimal("1.20"))  # fmt: skip
    assert PoolRevision.objects.filter(pool="us-east/l4").count() == 2  # created, deleted

    usage_ingest(documents=[record(1, HOUR + timedelta(minutes=5))])
    usage_hours_refresh()
    # h100: 16 GPUs x $2.50 for half an hour, then 8 x $4.00; b held 1 GPU of the
    # 43,200 GPU-seconds: 1/12 of the cost is its. l4: 20 minutes; a100: 15 minutes.
    assert costs(HOUR) == {
        "us-east/h100": (Decimal(36), Decimal(3)),
        "us-east/l4": (Decimal("0.8"), Decimal(0)),
        "us-east/a100": (Decimal("1.2"), Decimal(0)),
    }
    assert PoolHour.objects.get(hour=HOUR, pool="us-east/h100").gpus == 16

    # Repriced again after the hour was frozen; a late record is costed as the hour was.
    pool_update(actor=None, pool=GPUPool.objects.get(name="h100"), data={"price_per_gpu_hour": 10})
    usage_ingest(documents=[record(2, HOUR + timedelta(minutes=50))])
    usage_hours_refresh()
    assert costs(HOUR)["us-east/h100"] == (Decimal(36), Decimal(3))


def test_history_before_a_pools_first_revision_is_costed_when_it_served() -> None:
    """Usage loaded after the fact (a month of history for a pool made today): the hours it
    served are costed for the whole hour with its first revision's facts; a pool that served
    nothing then did not exist then."""
    region = make_region("us-east")
    Tenant.objects.create(slug="acme", name="Acme")
    with services_clock(HOUR + timedelta(days=2)):
        pool = make_pool(region, "h100")
        make_pool(region, "spare", gpus_per_node=8, node_count=1)
        make_instance(make_deployment(make_model(), pool), "b", state="ready")
    usage_ingest(documents=[record(1, HOUR + timedelta(minutes=5))])
    usage_hours_refresh()
    assert costs(HOUR) == {"us-east/h100": (Decimal(40), Decimal("2.5"))}


def test_an_hour_frozen_before_revisions_is_read_with_its_pools_size_and_price() -> None:
    region = make_region("us-east")
    Tenant.objects.create(slug="acme", name="Acme")
    with services_clock(HOUR - timedelta(days=1)):
        make_instance(make_deployment(make_model(), make_pool(region, "h100")), "b", "ready")
    FleetHour.objects.create(
        hour=HOUR,
        taken_at=HOUR + timedelta(hours=1),
        pools=[{"pool": "us-east/h100", "gpus": 2, "price_per_gpu_hour": "1.5"}],
        instances=[],
    )
    usage_ingest(documents=[record(1, HOUR + timedelta(minutes=5))])
    usage_hours_refresh()
    assert costs(HOUR) == {"us-east/h100": (Decimal(3), Decimal("1.5"))}
