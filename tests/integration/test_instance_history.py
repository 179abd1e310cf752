"""Instance history: an hour recomputed after the inventory changed is costed with the
instances it really had, each for the part of the hour it held its GPUs (real PostgreSQL).

An instance is stopped ten minutes into an hour and deleted before any rollup; its records
arrive late. The hour's pool and usage costs equal those computed from the fleet as it was —
the stopped instance for ten minutes, the other for the hour — and allocated + unallocated is
the pool's cost exactly; a later late record is costed on the same facts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from federation.inventory import lifecycle
from federation.inventory.models import Deployment, Instance, InstanceInterval
from federation.inventory.services import instance_delete, instance_transition
from federation.inventory.speed import decode_tokens_per_s, prefill_tokens_per_s
from federation.metering.cost import InstanceHour, pool_hour_cost, whole_hour
from federation.metering.models import PoolHour, UsageHour
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
POOL = "us-east/h100"


def record(i: int, instance: str, tenant: str, minute: int, prompt: int, output: int) -> bytes:
    return encode_record(
        Doc(
            request_id=f"req-{i}",
            started_at=(HOUR + timedelta(minutes=minute)).timestamp(),
            region="us-east",
            entry_region="us-east",
            instance=instance,
            model=Deployment.objects.get().model.name,
            adapter=None,
            tenant=tenant,
            key_prefix=None,
            prompt_tokens=prompt,
            cached_tokens=0,
            completion_tokens=output,
            ttft_ms=10.0,
            duration_ms=100.0,
            status=200,
            streamed=False,
            cancelled=False,
            usage_reported=True,
            edge=None,
        )
    )


def as_it_was(deployment: Deployment, usage: dict[str, dict[str, tuple[int, int]]]) -> object:
    """The hour computed by hand from the fleet as it stood: ``a`` held its GPU for the first
    ten minutes, ``b`` for the whole hour."""
    dep = deployment
    speed = dep.pool.accelerator.relative_speed
    params_b = float(dep.model.parameter_count_b)
    kw = {"relative_speed": speed, "tensor_parallel_size": 1, "params_b": params_b}
    prefill, decode = prefill_tokens_per_s(**kw), decode_tokens_per_s(**kw)
    return pool_hour_cost(
        spans=whole_hour(dep.pool.total_gpus, dep.pool.price_per_gpu_hour),
        instances=[
            InstanceHour(
                "a",
                1,
                prefill,
                decode,
                {(t, dep.model.name, "us-east", POOL): u for t, u in usage["a"].items()},
                held_s=600,
            ),
            InstanceHour(
                "b",
                1,
                prefill,
                decode,
                {(t, dep.model.name, "us-east", POOL): u for t, u in usage["b"].items()},
                held_s=3600,
            ),
        ],
    )


def test_an_instance_stopped_mid_hour_costs_ten_minutes_when_its_records_come_late() -> None:
    region = make_region("us-east")
    deployment = make_deployment(make_model(), make_pool(region, "h100"), max_replicas=4)
    for name in ("a", "b"):
        with services_clock(HOUR - timedelta(days=1)):
            make_instance(deployment, name, state="ready")
    Tenant.objects.create(slug="acme", name="Acme")
    Tenant.objects.create(slug="globex", name="Globex")

    # a stops ten minutes into the hour; days later it is deleted and another instance
    # starts, all before the hour is first rolled up.
    with services_clock(HOUR + timedelta(minutes=10)):
        instance_transition(actor=None, instance=Instance.objects.get(name="a"), state="stopped")
    instance_delete(actor=None, instance=Instance.objects.get(name="a"))
    make_instance(deployment, "c", state="ready")
    [interval] = InstanceInterval.objects.filter(name="a")
    assert interval.instance is None and interval.end_state == lifecycle.STOPPED
    assert interval.ended_at == HOUR + timedelta(minutes=10)

    # The hour's records arrive late (a spool replayed after the inventory changed).
    usage_ingest(
        documents=[
            record(1, "a", "acme", 2, 4_000, 800),
            record(2, "a", "globex", 8, 1_000, 100),
            record(3, "b", "acme", 30, 2_000, 2_000),
        ]
    )
    usage_hours_refresh()
    expected = as_it_was(
        deployment,
        {"a": {"acme": (4_000, 800), "globex": (1_000, 100)}, "b": {"acme": (2_000, 2_000)}},
    )
    row = PoolHour.objects.get(hour=HOUR, pool=POOL)
    assert (row.cost_usd, row.allocated_usd, row.idle_usd, row.warm_idle_usd) == (
        expected.cost,
        sum(expected.allocated.values()),
        expected.idle,
        expected.warm_idle,
    )
    assert row.allocated_usd + row.idle_usd + row.warm_idle_usd == row.cost_usd
    costs = {(u.tenant, u.pool): u.cost_usd for u in UsageHour.objects.filter(hour=HOUR)}
    assert costs == {(g[0], g[3]): c for g, c in expected.allocated.items()}
    # a's ten minutes of one GPU, b's hour of one: the rest of the pool is idle.
    price = deployment.pool.price_per_gpu_hour
    assert abs(row.allocated_usd - price * Decimal(7) / 6) <= Decimal("1e-12")
    assert row.idle_usd == row.cost_usd - row.allocated_usd

    # Another late record of the hour, after it was frozen: costed on the same facts.
    usage_ingest(documents=[record(4, "b", "globex", 50, 500, 500)])
    usage_hours_refresh()
    expected = as_it_was(
        deployment,
        {
            "a": {"acme": (4_000, 800), "globex": (1_000, 100)},
            "b": {"acme": (2_000, 2_000), "globex": (500, 500)},
        },
    )
    again = PoolHour.objects.get(hour=HOUR, pool=POOL)
    assert (again.allocated_usd, again.idle_usd) == (row.allocated_usd, row.idle_usd)
    costs = {u.tenant: u.cost_usd for u in UsageHour.objects.filter(hour=HOUR)}
    assert costs == {
        tenant: sum((c for g, c in expected.allocated.items() if g[0] == tenant), Decimal(0))
        for tenant in ("acme", "globex")
    }
    assert sum(costs.values()) == again.allocated_usd
