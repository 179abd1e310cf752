"""Usage ingestion on the real PostgreSQL and Redis: priced exactly, stored once however often
a record arrives, hourly rollups equal to the records, a batch acknowledged only after its
commit, a dead consumer's batch claimed and ingested, bad documents set aside with a reason."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import redis
from django.db import connection
from rest_framework.test import APIClient

from federation.inventory.models import GPUPool, Instance, InstanceInterval, PoolRevision, Region
from federation.inventory.services import pool_update
from federation.metering.models import (
    FleetHour,
    PoolHour,
    StaleUsageHour,
    UsageDeadLetter,
    UsageHour,
    UsageRecord,
)
from federation.metering.partitions import partition_name
from federation.metering.pricing import Price
from federation.metering.rollups import usage_hours_close, usage_hours_refresh
from federation.metering.selectors import UsageQuery, pool_cost_report, usage_report
from federation.metering.services import model_price_set, usage_ingest
from federation.metering.stream import GROUP, usage_stream_consume
from federation.tenancy.models import Tenant
from regions.tables.usage import USAGE_STREAM, encode_record
from regions.tables.usage import UsageRecord as Doc
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
    services_clock,
)
from tests.integration.usage_stream_support import STREAM_EDGE, signed, stream_edge

pytestmark = pytest.mark.django_db

HOUR = datetime(2026, 11, 30, 14, 0, tzinfo=UTC)
LIST = Price(Decimal("0.15"), Decimal("0.075"), Decimal("0.60"))
ACME = Price(Decimal("0.10"), Decimal("0.01"), Decimal("0.40"))


@pytest.fixture
def fleet() -> str:
    region = make_region("us-east")
    model = make_model()
    deployment = make_deployment(model, make_pool(region, "h100"))
    make_instance(deployment, "us-1", state="ready")
    # It and its pool have held their GPUs since well before the hours these tests cost.
    InstanceInterval.objects.filter(name="us-1").update(started_at=HOUR - timedelta(days=1))
    PoolRevision.objects.update(effective_from=HOUR - timedelta(days=1))
    Tenant.objects.create(slug="acme", name="Acme")
    Tenant.objects.create(slug="globex", name="Globex")
    model_price_set(actor=None, model=model, price=LIST, effective_from=HOUR - timedelta(days=1))
    model_price_set(
        actor=None,
        model=model,
        price=ACME,
        effective_from=HOUR,
        tenant=Tenant.objects.get(slug="acme"),
    )
    return model.name


def doc(i: int, model: str, tenant: str, minute: int = 5, **kw: object) -> Doc:
    fields: dict[str, object] = {
        "request_id": f"req-{i}",
        "started_at": (HOUR + timedelta(minutes=minute, seconds=i)).timestamp(),
        "region": "us-east",
        "entry_region": "us-east",
        "instance": "us-1",
        "model": model,
        "tenant": tenant,
        "key_prefix": "fi_abc",
        "prompt_tokens": 1000 + i,
        "cached_tokens": 512,
        "completion_tokens": 200 + i,
        "duration_ms": 900.0,
        **kw,
    }
    return Doc(**fields)  # type: ignore[arg-type]


def expected_price(d: Doc, p: Price) -> Decimal:
    fresh = d.prompt_tokens - d.cached_tokens
    return (
        fresh * p.input_per_mtok
        + d.cached_tokens * p.cached_input_per_mtok
        + d.completion_tokens * p.output_per_mtok
    ) / Decimal(1_000_000)


def test_records_are_priced_exactly_stored_once_and_rolled_up(fleet: str) -> None:
    docs = [doc(i, fleet, "acme" if i % 2 else "globex") for i in range(40)]
    # A late record of the previous hour: priced at the list price (acme's starts at HOUR).
    early = doc(99, fleet, "acme", minute=-30)
    batch = [encode_record(d) for d in [*docs, early]]
    assert usage_ingest(documents=batch).accepted == 41
    assert usage_ingest(documents=batch[:20]).accepted == 20  # shipped again: no duplicate
    assert UsageRecord.objects.count() == 41

    stored = {r.request_id: r for r in UsageRecord.objects.all()}
    for d in docs:
        price = ACME if d.tenant == "acme" else LIST
        assert stored[d.request_id].price_usd == expected_price(d, price)
        assert stored[d.request_id].pool == "us-east/h100"
    assert stored["req-99"].price_usd == expected_price(early, LIST)

    assert sorted(usage_hours_refresh()) == [HOUR - timedelta(hours=1), HOUR]
    assert not StaleUsageHour.objects.exists()
    for tenant in ("acme", "globex"):
        row = UsageHour.objects.get(hour=HOUR, tenant=tenant)
        mine = [d for d in docs if d.tenant == tenant]
        assert row.requests == len(mine) == 20
        assert row.prompt_tokens == sum(d.prompt_tokens for d in mine)
        assert row.completion_tokens == sum(d.completion_tokens for d in mine)
        assert row.price_usd == sum(
            (stored[d.request_id].price_usd for d in mine), start=Decimal(0)
        )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_inherits WHERE inhrelid::regclass::text = %s",
            [partition_name(2026, 11)],
        )
        assert cursor.fetchone() == (1,)


def test_each_pool_hour_is_accounted_for_exactly(fleet: str) -> None:
    """Every pool's hour (here an H100 pool of 16 GPUs running one TP-1 instance, and an idle
    L4 pool) is split into what the usage groups carry and what is unallocated, exactly."""
    make_pool(
        Region.objects.get(code="us-east"),
        "l4",
        accelerator="L4-24G",
        interconnect="pcie",
        price_per_gpu_hour=Decimal("0.70"),
    )
    PoolRevision.objects.update(effective_from=HOUR - timedelta(days=1))  # it existed then
    docs = [doc(i, fleet, ("acme", "globex", "initech")[i % 3]) for i in range(30)]
    usage_ingest(documents=[encode_record(d) for d in docs])
    usage_hours_refresh()
    h100 = PoolHour.objects.get(hour=HOUR, pool="us-east/h100")
    assert h100.cost_usd == 16 * Decimal("2.50")
    assert h100.idle_usd == 15 * Decimal("2.50")  # 15 GPUs run no instance
    assert h100.warm_idle_usd == 0
    groups = UsageHour.objects.filter(hour=HOUR, pool="us-east/h100")
    assert h100.allocated_usd == sum((g.cost_usd for g in groups), start=Decimal(0))
    assert h100.reprefill_usd == 0  # no stream was continued
    assert _reconciles(h100)
    assert h100.allocated_usd == Decimal("2.50")  # the instance's GPU-hour, all carried
    assert {g.tenant for g in groups if g.cost_usd > 0} == {"acme", "globex", "initech"}
    by_tenant = usage_report(
        UsageQuery(
            HOUR, HOUR + timedelta(days=1), group_by=["tenant"], bucket="day", with_cost=True
        )
    )
    assert [(r["tenant"], r["requests"]) for r in by_tenant] == [
        ("acme", 10),
        ("globex", 10),
        ("initech", 10),
    ]
    assert sum((r["cost_usd"] for r in by_tenant), start=Decimal(0)) == h100.allocated_usd
    for r in by_tenant:
        assert r["day"] == HOUR.date()
        assert r["margin_usd"] == r["price_usd"] - r["cost_usd"]
    [acme] = usage_report(UsageQuery(HOUR, HOUR + timedelta(hours=1), filters={"tenant": ["acme"]}))
    assert "cost_usd" not in acme and acme["requests"] == 10
    pools = pool_cost_report(start=HOUR, end=HOUR + timedelta(hours=1))
    assert [p["pool"] for p in pools] == ["us-east/h100", "us-east/l4"]
    l4 = PoolHour.objects.get(hour=HOUR, pool="us-east/l4")
    assert (l4.cost_usd, l4.idle_usd, l4.allocated_usd) == (16 * Decimal("0.70"),) * 2 + (0,)


def test_a_late_record_makes_its_hour_recomputed(fleet: str) -> None:
    usage_ingest(documents=[encode_record(doc(1, fleet, "acme"))])
    usage_hours_refresh()
    usage_ingest(documents=[encode_record(doc(2, fleet, "acme"))])
    assert usage_hours_refresh() == [HOUR]
    assert UsageHour.objects.get(hour=HOUR, tenant="acme").requests == 2


def test_bad_documents_are_returned_with_the_reason_and_the_rest_is_stored(fleet: str) -> None:
    too_cached = doc(1, fleet, "acme", cached_tokens=5000)
    result = usage_ingest(
        documents=[b"{not json", encode_record(too_cached), encode_record(doc(2, fleet, "acme"))]
    )
    assert result.accepted == 1
    assert [refusal.reason.split(":")[0] for refusal in result.rejected] == [
        "usage record does not decode",
        "token counts must be >= 0, cached within the prompt",
    ]
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["req-2"]


@pytest.fixture
def stream() -> redis.Redis:
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.delete(USAGE_STREAM)
    yield client
    client.delete(USAGE_STREAM)


def test_the_stream_is_acknowledged_after_the_commit_and_a_dead_consumers_batch_is_claimed(
    fleet: str, stream: redis.Redis
) -> None:
    stream_edge(Region.objects.get(code="us-east"))
    for i in range(30):
        stream.xadd(USAGE_STREAM, signed(encode_record(doc(i, fleet, "acme", edge=STREAM_EDGE))))
    stream.xadd(USAGE_STREAM, {b"other": b"x"})
    # A worker that read ten entries and was killed before it committed.
    stream.xgroup_create(USAGE_STREAM, GROUP, id="0")
    stream.xreadgroup(GROUP, "dead-worker", {USAGE_STREAM: ">"}, count=10)

    with services_clock(HOUR + timedelta(hours=1)):
        first = usage_stream_consume(stream, consumer="live", batch=8)
    assert first.records == 20  # the 20 entries nobody had read (and one with no record)
    assert first.rejected == 1
    assert UsageRecord.objects.count() == 20
    assert stream.xpending(USAGE_STREAM, GROUP)["pending"] == 10  # the dead worker's, unacked

    with services_clock(HOUR + timedelta(hours=1)):
        second = usage_stream_consume(stream, consumer="live", batch=8, claim_idle_ms=0)
    assert second.records == 10
    assert UsageRecord.objects.count() == 30
    assert stream.xpending(USAGE_STREAM, GROUP)["pending"] == 0
    assert stream.xlen(USAGE_STREAM) == 0
    [rejected] = UsageDeadLetter.objects.all()
    assert "has no record" in rejected.reason and not rejected.authenticated


def test_an_edge_posts_its_own_regions_usage_and_a_2xx_means_it_is_stored(fleet: str) -> None:
    from federation.inventory import services as inventory
    from federation.routing import services as routing

    region = Region.objects.get(code="us-east")
    eu = make_region("eu-west", "EU")
    edge = inventory.edge_register(actor=None, region=region, name="edge-us", url="http://e:1")
    other = inventory.edge_register(actor=None, region=eu, name="edge-eu", url="http://f:1")
    credential = routing.edge_credential_rotate(actor=None, edge=edge)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {credential}")
    lines = [encode_record(doc(i, fleet, "acme", edge="edge-us")) for i in range(3)]
    # Its worker processes sign their own records (``--workers``): theirs, not another edge's.
    lines.append(encode_record(doc(3, fleet, "acme", edge="edge-us.1")))
    foreign = encode_record(doc(9, fleet, "acme", region="eu-west", edge="edge-us"))
    impostor = encode_record(doc(8, fleet, "acme", edge="edge-eu"))
    not_its = ["edge-eu.1", "edge-us.x", "edge-us.01", "edge-us.32"]
    impostors = [encode_record(doc(10 + n, fleet, "acme", edge=e)) for n, e in enumerate(not_its)]
    body = b"\n".join([*lines, foreign, impostor, *impostors, b"{broken"]) + b"\n"

    def post(name: str) -> Any:
        return client.generic(
            "POST", f"/api/v1/edges/{name}/usage", body, content_type="application/x-ndjson"
        )

    with services_clock(HOUR + timedelta(hours=1)):
        r = post("edge-us")
    assert r.status_code == 200, r.content
    assert r.json()["accepted"] == 4
    refused = r.json()["rejected"]
    assert [x["index"] for x in refused] == list(range(4, 4 + len(refused)))
    foreign_region, foreign_edge, *not_its_workers, broken = [x["reason"] for x in refused]
    assert foreign_region == "a record of region 'eu-west'"
    assert foreign_edge == "a record of edge 'edge-eu'"
    assert not_its_workers == [
        f"a record of edge '{name}'"
        for name in ("edge-eu.1", "edge-us.x", "edge-us.01", "edge-us.32")
    ]
    assert broken.startswith("usage record does not decode")
    with services_clock(HOUR + timedelta(hours=1)):
        assert post("edge-us").json()["accepted"] == 4  # sent again: stored once
    assert UsageDeadLetter.objects.filter(source="http", edge="edge-us").count() == 7  # once
    assert UsageRecord.objects.count() == 4
    assert UsageRecord.objects.filter(edge="edge-us.1").count() == 1
    assert post(other.name).status_code == 403  # not its own name
    anonymous = APIClient().generic(
        "POST", "/api/v1/edges/edge-us/usage", body, content_type="application/x-ndjson"
    )
    assert anonymous.status_code == 401


def test_every_closed_hour_gets_its_pool_costs_even_with_no_usage(fleet: str) -> None:
    now = HOUR + timedelta(minutes=20)
    marked = usage_hours_close(now=now, lookback_hours=3)
    assert marked == [HOUR - timedelta(hours=h) for h in (3, 2, 1)]
    usage_hours_refresh()
    assert PoolHour.objects.filter(pool="us-east/h100").count() == 3
    assert usage_hours_close(now=now, lookback_hours=3) == []
    idle = PoolHour.objects.get(hour=HOUR - timedelta(hours=1), pool="us-east/h100")
    assert idle.warm_idle_usd == Decimal("2.50") and idle.allocated_usd == 0


def test_the_workers_tasks_ingest_the_stream_and_roll_up(
    fleet: str, stream: redis.Redis, settings: Any
) -> None:
    from workers.tasks import usage_ingest_task, usage_rollup_task

    settings.REDIS_URL = os.environ["REDIS_URL"]
    stream_edge(Region.objects.get(code="us-east"))
    for i in range(5):
        stream.xadd(USAGE_STREAM, signed(encode_record(doc(i, fleet, "acme", edge=STREAM_EDGE))))
    with services_clock(HOUR + timedelta(hours=1)):
        assert usage_ingest_task() == 5
    assert usage_rollup_task() >= 1
    assert UsageHour.objects.get(hour=HOUR, tenant="acme").requests == 5


def test_metered_spend_exhausts_a_budget_in_the_next_tables(fleet: str) -> None:
    from federation.routing.compiler import compile_fleet_tables
    from federation.routing.selectors import fleet_snapshot

    Tenant.objects.filter(slug="globex").update(monthly_budget_usd=Decimal("0.02"))
    Tenant.objects.filter(slug="acme").update(monthly_budget_usd=Decimal("1000"))
    now = datetime.now(UTC)

    def budgets() -> dict[str, str]:
        snapshot = fleet_snapshot(now=now)
        [table] = compile_fleet_tables(snapshot, versions={"us-east": 1}, generated_at="x").values()
        return {t["tenant"]: t["budget_state"] for t in table["tenants"]}

    assert budgets() == {"acme": "ok", "globex": "ok"}
    this_hour = now.replace(minute=0, second=0, microsecond=0)
    big = {"prompt_tokens": 20_000, "cached_tokens": 0, "completion_tokens": 10_000}
    docs = [
        doc(i, fleet, tenant, started_at=(this_hour + timedelta(seconds=i)).timestamp(), **big)
        for i, tenant in enumerate(["globex"] * 4 + ["acme"])
    ]
    usage_ingest(documents=[encode_record(d) for d in docs])
    usage_hours_refresh()
    assert budgets() == {"acme": "ok", "globex": "exhausted"}  # 4 x $0.009 > $0.02


def _pool_hour(hour: datetime) -> PoolHour:
    return PoolHour.objects.get(hour=hour, pool="us-east/h100")


def _reconciles(row: PoolHour) -> bool:
    unallocated = row.idle_usd + row.warm_idle_usd + row.reprefill_usd
    return row.allocated_usd + unallocated == row.cost_usd


def test_an_ended_hour_is_costed_again_with_the_fleet_it_had(fleet: str) -> None:
    usage_ingest(documents=[encode_record(doc(i, fleet, "acme")) for i in range(4)])
    usage_hours_refresh()
    first = _pool_hour(HOUR)
    assert first.cost_usd == Decimal("40.00") and _reconciles(first)  # 16 GPUs x $2.50
    assert FleetHour.objects.filter(hour=HOUR).exists()
    # Days later (at the start of this hour) the pool's price doubles, its instance is
    # stopped and another starts...
    now = datetime.now(UTC)
    this_hour = now.replace(minute=0, second=0, microsecond=0)
    with services_clock(this_hour):
        pool_update(
            actor=None,
            pool=GPUPool.objects.get(name="h100"),
            data={"price_per_gpu_hour": Decimal("5.00")},
        )
    deployment = Instance.objects.get(name="us-1").deployment
    Instance.objects.filter(name="us-1").update(state="stopped")
    make_instance(deployment, "us-2", state="ready")
    # ... and a late record of the hour arrives: the hour keeps its fleet.
    usage_ingest(documents=[encode_record(doc(9, fleet, "globex", minute=50))])
    usage_hours_refresh()
    again = _pool_hour(HOUR)
    assert again.cost_usd == first.cost_usd and again.idle_usd == first.idle_usd
    assert again.warm_idle_usd == 0 and _reconciles(again)  # us-2 was not there
    costs = dict(UsageHour.objects.filter(hour=HOUR).values_list("tenant", "cost_usd"))
    assert sum(costs.values()) == again.allocated_usd == Decimal("2.50")  # us-1's one GPU
    assert costs["globex"] > 0
    # An hour not yet ended is costed with the fleet as it is.
    usage_ingest(
        documents=[
            encode_record(doc(20, fleet, "acme", instance="us-2", started_at=now.timestamp()))
        ]
    )
    usage_hours_refresh()
    assert _pool_hour(this_hour).cost_usd == Decimal("80.00")
    assert not FleetHour.objects.filter(hour=this_hour).exists()


def test_an_instance_that_left_before_the_hour_ended_keeps_its_share(fleet: str) -> None:
    deployment = Instance.objects.get(name="us-1").deployment
    deployment.max_replicas = 4
    deployment.save()
    make_instance(deployment, "us-0", state="ready")
    Instance.objects.filter(name="us-0").update(state="stopped")  # gone before the hour ended
    usage_ingest(documents=[encode_record(doc(1, fleet, "acme", instance="us-0"))])
    usage_hours_refresh()
    row = _pool_hour(HOUR)
    assert row.allocated_usd == Decimal("2.50") and row.warm_idle_usd == Decimal("2.50")
    frozen = FleetHour.objects.get(hour=HOUR)
    assert sorted(i["instance"] for i in frozen.instances) == ["us-0", "us-1"]
    # A late record of a third instance that has since stopped is added to the frozen facts.
    make_instance(deployment, "us-3", state="ready")
    Instance.objects.filter(name="us-3").update(state="stopped")
    usage_ingest(documents=[encode_record(doc(2, fleet, "globex", instance="us-3"))])
    usage_hours_refresh()
    frozen.refresh_from_db()
    assert sorted(i["instance"] for i in frozen.instances) == ["us-0", "us-1", "us-3"]
    row = _pool_hour(HOUR)
    assert row.allocated_usd == Decimal("5.00") and _reconciles(row)
