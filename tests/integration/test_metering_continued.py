"""A stream continued on another instance (issue 31), on the real PostgreSQL and Redis: one
record, stored once, priced on the prompt once and the completion the client received; the
prompt and relayed text processed again to continue it (``reprefill_tokens``) is the operator's
cost — a line of each pool's hour, carried by no tenant. Schema-3 records still ingest."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
import redis
from django.db import connection
from rest_framework.test import APIClient

from federation.inventory.models import Instance, InstanceInterval, Region
from federation.metering.cost import split_exactly
from federation.metering.models import (
    CountedSpend,
    FleetHour,
    PoolHour,
    UsageDeadLetter,
    UsageHour,
    UsageRecord,
)
from federation.metering.rollups import usage_hours_refresh
from federation.metering.services import usage_ingest
from federation.metering.stream import usage_stream_consume
from regions.tables.usage import USAGE_STREAM, encode_record, encode_split_id_record
from regions.tables.usage import UsageRecord as Doc
from tests.integration.inventory_factories import make_instance, services_clock
from tests.integration.test_metering_ingest import (  # noqa: F401  (fixtures)
    ACME,
    HOUR,
    LIST,
    doc,
    expected_price,
    fleet,
    stream,
)
from tests.integration.usage_stream_support import STREAM_EDGE, signed, stream_edge

pytestmark = pytest.mark.django_db

#: Cut after 150 tokens on us-0, continued on us-1: the prompt (1,001) and the 150 tokens
#: relayed were prefilled again there.
CONTINUED = {
    "continued": 1,
    "legs": "us-east/us-0,us-east/us-1",
    "continuation_reason": "engine_lost",
    "reprefill_tokens": 1001 + 150,
}


def test_a_continued_request_is_stored_once_and_priced_on_what_the_client_received(
    fleet: str,  # noqa: F811
) -> None:
    continued = doc(1, fleet, "acme", **CONTINUED)
    document = encode_record(continued)
    assert document.startswith(b"[4,")
    assert document.endswith(b'null,1,"us-east/us-0,us-east/us-1","engine_lost",1151]')
    assert usage_ingest(documents=[document]).accepted == 1
    # Shipped again (a restarted edge), even as an older edge would have written it: once.
    assert usage_ingest(documents=[document, encode_split_id_record(continued)]).accepted == 2
    [row] = UsageRecord.objects.all()
    assert (row.continued, row.legs, row.continuation_reason, row.reprefill_tokens) == (
        1,
        "us-east/us-0,us-east/us-1",
        "engine_lost",
        1151,
    )
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (1001, 512, 201)
    assert row.instance == "us-1" and row.pool == "us-east/h100"
    # The tenant's price: its prompt once and the completion it received, nothing re-prefilled.
    plain = doc(1, fleet, "acme")
    assert row.price_usd == expected_price(continued, ACME) == expected_price(plain, ACME)
    [counted] = CountedSpend.objects.all()
    assert (counted.tenant, counted.price_usd) == ("acme", row.price_usd)  # counted once


def test_a_request_served_by_one_engine_stores_no_continuation(fleet: str) -> None:  # noqa: F811
    usage_ingest(documents=[encode_record(doc(1, fleet, "acme"))])
    [row] = UsageRecord.objects.all()
    assert (row.continued, row.legs, row.continuation_reason, row.reprefill_tokens) == (
        0,
        "",
        "",
        0,
    )


def _engine_s(d: Doc, prefill: float, decode: float) -> float:
    return (d.prompt_tokens - d.cached_tokens) / prefill + d.completion_tokens / decode


def test_reprefill_is_the_operators_cost_and_no_tenants(fleet: str) -> None:  # noqa: F811
    """us-1 (one GPU of the 16-GPU pool, $2.50 its hour) served acme's continued stream and
    globex's plain one: the two carry their own engine time's share, the re-prefill's share is
    the pool hour's ``reprefill_usd``, and the pool's hour still adds up to the last digit."""
    acme = doc(1, fleet, "acme", **CONTINUED)
    globex = doc(2, fleet, "globex")
    usage_ingest(documents=[encode_record(acme), encode_record(globex)])
    usage_hours_refresh()

    [us1] = [i for i in FleetHour.objects.get(hour=HOUR).instances if i["instance"] == "us-1"]
    prefill, decode = us1["prefill_tokens_per_s"], us1["decode_tokens_per_s"]
    weights = {
        "acme": _engine_s(acme, prefill, decode),
        "globex": _engine_s(globex, prefill, decode),
        "operator": acme.reprefill_tokens / prefill,
    }
    expected = split_exactly(Decimal("2.50"), weights)
    costs = dict(UsageHour.objects.filter(hour=HOUR).values_list("tenant", "cost_usd"))
    assert costs == {"acme": expected["acme"], "globex": expected["globex"]}
    pool = PoolHour.objects.get(hour=HOUR, pool="us-east/h100")
    assert pool.reprefill_usd == expected["operator"] > 0
    assert pool.allocated_usd == expected["acme"] + expected["globex"]
    assert pool.idle_usd == 15 * Decimal("2.50") and pool.warm_idle_usd == 0
    assert pool.allocated_usd + pool.idle_usd + pool.warm_idle_usd + pool.reprefill_usd == (
        pool.cost_usd
    )
    # Without the re-prefill's line, acme would have carried its engine time (and more of the
    # instance's warm time) as if one engine had served it: not more.
    alone = split_exactly(Decimal("2.50"), {k: weights[k] for k in ("acme", "globex")})
    assert costs["acme"] < alone["acme"] and costs["globex"] < alone["globex"]
    # Prices are untouched by any of it.
    prices = dict(UsageHour.objects.filter(hour=HOUR).values_list("tenant", "price_usd"))
    assert prices == {"acme": expected_price(acme, ACME), "globex": expected_price(globex, LIST)}


def test_the_reprefill_is_costed_on_the_instance_that_did_it(fleet: str) -> None:  # noqa: F811
    """us-1's stream continued on us-2 (as a continuation in another region is recorded: the
    record names the instance that was cut). us-2 did nothing else in the hour: its whole
    GPU-hour is the operator's, not warm idle and not acme's; a leg that names no instance of
    the fleet leaves the re-prefill on the record's instance."""
    deployment = Instance.objects.get(name="us-1").deployment
    deployment.max_replicas = 4
    deployment.save()
    make_instance(deployment, "us-2", state="ready")
    InstanceInterval.objects.filter(name="us-2").update(started_at=HOUR - timedelta(days=1))
    moved = {**CONTINUED, "legs": "us-east/us-1,us-east/us-2"}
    usage_ingest(documents=[encode_record(doc(1, fleet, "acme", **moved))])
    usage_hours_refresh()
    pool = PoolHour.objects.get(hour=HOUR, pool="us-east/h100")
    assert (pool.allocated_usd, pool.reprefill_usd, pool.warm_idle_usd) == (
        Decimal("2.50"),
        Decimal("2.50"),
        0,
    )
    assert UsageHour.objects.get(hour=HOUR, tenant="acme").cost_usd == Decimal("2.50")

    unnamed = {**CONTINUED, "legs": "us-east/us-1,eu-west/?"}
    usage_ingest(documents=[encode_record(doc(2, fleet, "globex", **unnamed))])
    usage_hours_refresh()
    pool = PoolHour.objects.get(hour=HOUR, pool="us-east/h100")  # recomputed: a new row
    # us-2 still re-prefilled alone; us-1's GPU-hour is now shared with its own re-prefill.
    assert Decimal("2.50") < pool.reprefill_usd < Decimal("5.00")
    assert pool.allocated_usd + pool.reprefill_usd == Decimal("5.00") and pool.warm_idle_usd == 0


def test_the_cost_report_lists_the_reprefill_line(
    fleet: str,  # noqa: F811
    operator_client: APIClient,
) -> None:
    usage_ingest(documents=[encode_record(doc(1, fleet, "acme", **CONTINUED))])
    usage_hours_refresh()
    day = {"start": HOUR.date().isoformat(), "end": (HOUR + timedelta(days=1)).date().isoformat()}
    r = operator_client.get("/api/v1/costs/", {"bucket": "hour", "pool": "us-east/h100", **day})
    [row] = r.json()["results"]
    parts = ("allocated_usd", "idle_usd", "warm_idle_usd", "reprefill_usd")
    assert sum(Decimal(row[p]) for p in parts) == Decimal(row["cost_usd"]) == 16 * Decimal("2.5")
    assert Decimal(row["reprefill_usd"]) > 0


def test_schema_3_and_4_records_ingest_from_the_stream_and_a_bad_continuation_is_refused(
    fleet: str,  # noqa: F811
    stream: redis.Redis,  # noqa: F811
) -> None:
    """An upgraded edge ships what its spool held before (schema 3) beside its new records."""
    stream_edge(Region.objects.get(code="us-east"))
    older = encode_split_id_record(doc(1, fleet, "acme", edge=STREAM_EDGE))
    newer = encode_record(doc(2, fleet, "acme", edge=STREAM_EDGE, **CONTINUED))
    bad = encode_record(doc(3, fleet, "acme", edge=STREAM_EDGE, reprefill_tokens=10))
    assert older.startswith(b"[3,") and newer.startswith(b"[4,")
    stream.xadd(USAGE_STREAM, signed(b"\n".join([older, newer, bad])))
    with services_clock(HOUR + timedelta(hours=1)):
        result = usage_stream_consume(stream, consumer="live")
    assert (result.records, result.rejected) == (2, 1)
    rows = dict(UsageRecord.objects.values_list("request_id", "continued"))
    assert rows == {"req-1": 0, "req-2": 1}
    [letter] = UsageDeadLetter.objects.all()
    assert bytes(letter.document) == bad
    assert "for a continued record only" in letter.reason


def test_rows_written_by_sql_without_the_new_columns_get_their_defaults(
    fleet: str,  # noqa: F811
) -> None:
    """Benchmarks and restores insert by SQL naming the columns schema 3 had: every partition
    has the database defaults (``migrations/metering/0005``)."""
    usage_ingest(documents=[encode_record(doc(1, fleet, "acme"))])  # makes the month's partition
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO metering_usagerecord (started_at, request_id, tenant, key_prefix, model, "
            "adapter, region, entry_region, instance, pool, prompt_tokens, cached_tokens, "
            "completion_tokens, ttft_ms, duration_ms, status, streamed, cancelled, "
            "usage_reported, price_usd, edge) VALUES (%s, 'sql-1', 'acme', '', %s, '', "
            "'us-east', 'us-east', 'us-1', 'us-east/h100', 10, 0, 5, NULL, 1.0, 200, false, "
            "false, true, 0, '')",
            [HOUR + timedelta(minutes=1), fleet],
        )
        cursor.execute(
            "INSERT INTO metering_poolhour (hour, pool, gpus, cost_usd, allocated_usd, idle_usd, "
            "warm_idle_usd, busy_s) VALUES (%s, 'x/y', 0, 0, 0, 0, 0, 0)",
            [HOUR],
        )
    row = UsageRecord.objects.get(request_id="sql-1")
    assert (row.continued, row.legs, row.continuation_reason, row.reprefill_tokens) == (
        0,
        "",
        "",
        0,
    )
    assert PoolHour.objects.get(pool="x/y").reprefill_usd == 0
