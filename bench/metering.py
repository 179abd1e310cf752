"""Metering on the real PostgreSQL (`python -m bench metering`): ingestion rate and report time.

(a) **Ingestion**: ``--records`` usage records (the edges' documents) through ``usage_ingest``
    in batches of 2,000, as the worker does — decode, price, ``COPY`` + ``INSERT … ON CONFLICT
    DO NOTHING`` — against the baseline of the same rows written with Django's
    ``bulk_create(ignore_conflicts=True)`` in the same run. Target: ≥ 20,000 records/s.
(b) **Reports**: a month of ``--month-records`` records (default ten million: 5 regions,
    3 pools each, 4 models, 200 tenants) written straight into the partitions by SQL, the hourly
    rollups and pool costs computed (``usage_hours_refresh``), then the month's report by tenant
    and day with cost and margin, and the pool cost report — median of 5 — against the same
    usage report computed from the raw records. Target: ≤ 300 ms.

The bench uses its own database ``<name of --database-url>_fedbench`` (dropped and created).
JSON under ``var/bench/``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from bench.harness.control_plane import MODEL, MODEL_SPEC, bench_database, setup_django
from bench.harness.procs import git_rev, machine_info
from bench.harness.report import fmt, markdown_table, utc_now, write_result

MONTH = datetime(2026, 10, 1, tzinfo=UTC)
REGIONS = ("us-east", "us-west", "eu-west", "eu-north", "ap-south")
POOLS = ("h100", "a100", "l40s")
MODELS = (MODEL, "llama-70b", "qwen-7b", "mistral-7b")


def build_fleet() -> None:
    """The pools the records name, a price list, and one ready instance per pool."""
    from federation.inventory import services as inv
    from federation.inventory.models import AcceleratorType
    from federation.metering.pricing import Price
    from federation.metering.services import model_price_set

    accelerators = dict(zip(POOLS, ("H100-80G", "A100-80G", "L40S-48G"), strict=True))
    model = inv.model_create(actor=None, **MODEL_SPEC)
    model_price_set(
        actor=None,
        model=model,
        price=Price(Decimal("0.15"), Decimal("0.075"), Decimal("0.60")),
        effective_from=MONTH - timedelta(days=31),
    )
    for i, code in enumerate(REGIONS):
        region = inv.region_create(
            actor=None,
            code=code,
            name=code,
            provider="cloud",
            latitude=10.0 + i,
            longitude=20.0 + i,
            jurisdiction="US",
        )
        for pool_name in POOLS:
            accelerator = AcceleratorType.objects.get(name=accelerators[pool_name])
            pool = inv.pool_create(
                actor=None,
                region=region,
                name=pool_name,
                accelerator=accelerator,
                gpus_per_node=8,
                node_count=4,
                interconnect="pcie" if pool_name == "l40s" else "nvlink",
                price_per_gpu_hour=Decimal("2.10"),
                capacity_type="on_demand",
            )
            dep = inv.deployment_create(actor=None, model=model, pool=pool, tensor_parallel_size=1)
            inst = inv.instance_create(
                actor=None,
                deployment=dep,
                name=f"{code}-{pool_name}-1",
                endpoint_url=f"http://{code}-{pool_name}-1.local:8000",
            )
            inv.instance_bring_up(actor=None, instance=inst)


def documents(n: int, start: datetime) -> list[bytes]:
    """``n`` usage records as the edges ship them, timestamped from ``start``."""
    from regions.tables.usage import UsageRecord, encode_record

    t0 = start.timestamp()
    return [
        encode_record(
            UsageRecord(
                request_id=uuid.uuid4().hex,
                started_at=t0 + i * 0.01,
                region=REGIONS[i % 5],
                entry_region=REGIONS[i % 5],
                instance=f"{REGIONS[i % 5]}-{POOLS[i % 3]}-1",
                model=MODEL,
                tenant=f"tenant-{i % 200}",
                key_prefix="fi_abcdef12",
                prompt_tokens=800 + i % 3000,
                cached_tokens=(i % 7) * 100,
                completion_tokens=50 + i % 500,
                ttft_ms=120.0,
                duration_ms=2400.0,
                streamed=bool(i % 2),
            )
        )
        for i in range(n)
    ]


def bench_ingest(n: int, batch: int = 2000) -> dict[str, Any]:
    """Ingestion through ``usage_ingest`` against the ORM's ``bulk_create`` on the same rows."""
    from django.db import connection, transaction

    from federation.metering import services
    from federation.metering.models import UsageRecord
    from federation.metering.partitions import ensure_months

    docs = documents(n, MONTH - timedelta(days=2))
    t = time.perf_counter()
    for i in range(0, n, batch):
        services.usage_ingest(documents=docs[i : i + batch])
    ours = n / (time.perf_counter() - t)
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE metering_usagerecord")
    fields = [f.name for f in UsageRecord._meta.concrete_fields]

    def orm_batch(chunk: list[bytes]) -> None:
        # The straightforward Django way, with the same decoding and pricing per record.
        from regions.tables.usage import decode_record

        records = [decode_record(d) for d in chunk]
        started = [datetime.fromtimestamp(r.started_at, tz=UTC) for r in records]
        pools = services._pools_of({r.instance for r in records})
        prices = services.PriceBook(r.model for r in records)
        rows = [
            UsageRecord(
                **dict(
                    zip(
                        services.COLUMNS,
                        services._row(r, at, pools.get(r.instance, ""), prices),
                        strict=True,
                    )
                )
            )
            for r, at in zip(records, started, strict=True)
        ]
        with transaction.atomic():
            ensure_months({(at.year, at.month) for at in started})
            UsageRecord.objects.bulk_create(rows, ignore_conflicts=True)

    t = time.perf_counter()
    for i in range(0, n, batch):
        orm_batch(docs[i : i + batch])
    baseline = n / (time.perf_counter() - t)
    assert len(fields) == len(services.COLUMNS)
    return {"records": n, "records_per_s": ours, "orm_records_per_s": baseline}


def fill_month(n: int) -> float:
    """``n`` records spread over :data:`MONTH`, written by SQL straight into the table."""
    from django.db import connection

    from federation.metering.partitions import ensure_months

    ensure_months({(MONTH.year, MONTH.month)})
    seconds = 30 * 24 * 3600
    t = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO metering_usagerecord (
                started_at, request_id, tenant, key_prefix, model, adapter, region,
                entry_region, instance, pool, prompt_tokens, cached_tokens, completion_tokens,
                ttft_ms, duration_ms, status, streamed, cancelled, usage_reported, price_usd, edge
            )
            SELECT %(start)s::timestamptz + (i * %(step)s) * interval '1 second',
                   'm-' || i, 'tenant-' || (i %% 200), 'fi_abcdef12',
                   (%(models)s::text[])[1 + i %% 4], '', (%(regions)s::text[])[1 + i %% 5],
                   (%(regions)s::text[])[1 + i %% 5],
                   concat_ws('-', (%(regions)s::text[])[1 + i %% 5],
                             (%(pools)s::text[])[1 + i %% 3], '1'),
                   concat_ws('/', (%(regions)s::text[])[1 + i %% 5],
                             (%(pools)s::text[])[1 + i %% 3]),
                   800 + i %% 3000, (i %% 7) * 100, 50 + i %% 500, 120.0, 2400.0,
                   CASE WHEN i %% 97 = 0 THEN 500 ELSE 200 END, i %% 2 = 0, i %% 53 = 0,
                   true, ((800 + i %% 3000) * 0.15 + (50 + i %% 500) * 0.6) / 1000000, ''
            FROM generate_series(0, %(last)s) AS i
            """,
            {
                "start": MONTH,
                "step": seconds / n,
                "last": n - 1,
                "models": list(MODELS),
                "regions": list(REGIONS),
                "pools": list(POOLS),
            },
        )
        cursor.execute("ANALYZE metering_usagerecord")
    return time.perf_counter() - t


def mark_month_stale() -> None:
    """Every hour of the month stale, so the refresh recomputes them all."""
    from federation.metering.rollups import usage_hours_mark_stale

    usage_hours_mark_stale(MONTH + timedelta(hours=h) for h in range(30 * 24))


def timed(fn: Any, runs: int = 5) -> float:
    """The median time of ``runs`` calls: one call is one noisy sample."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_reports(n: int) -> dict[str, Any]:
    """A month of records, its rollups, then the reports against the same from raw records."""
    from django.db.models import Count, Sum
    from django.db.models.functions import TruncDay

    from federation.metering.models import UsageRecord
    from federation.metering.rollups import usage_hours_refresh
    from federation.metering.selectors import UsageQuery, pool_cost_report, usage_report

    fill_s = fill_month(n)
    mark_month_stale()
    t = time.perf_counter()
    while usage_hours_refresh(limit=100):
        pass
    rollup_s = time.perf_counter() - t
    end = MONTH + timedelta(days=30)
    query = UsageQuery(MONTH, end, group_by=["tenant"], bucket="day", with_cost=True)
    rows = usage_report(query)
    report_s = timed(lambda: usage_report(query))
    pools_s = timed(lambda: pool_cost_report(start=MONTH, end=end, bucket="day"))

    def raw() -> list[dict[str, Any]]:
        return list(
            UsageRecord.objects.filter(started_at__gte=MONTH, started_at__lt=end)
            .annotate(day=TruncDay("started_at", tzinfo=UTC))
            .values("day", "tenant")
            .annotate(n=Count("request_id"), price=Sum("price_usd"))
            .order_by("day", "tenant")
        )

    raw_rows = raw()
    raw_s = timed(raw, runs=3)
    assert sum(r["requests"] for r in rows) == n == sum(r["n"] for r in raw_rows)
    return {
        "month_records": n,
        "fill_s": fill_s,
        "rollup_s": rollup_s,
        "report_rows": len(rows),
        "report_ms": report_s * 1000,
        "pool_report_ms": pools_s * 1000,
        "raw_report_ms": raw_s * 1000,
    }


def main(argv: list[str]) -> None:
    """Run both measurements; print the table and write the JSON under var/bench/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fedinfer"),
    )
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--month-records", type=int, default=10_000_000)
    args = parser.parse_args(argv)
    setup_django(bench_database(args.database_url))
    build_fleet()
    ingest = bench_ingest(args.records)
    reports = bench_reports(args.month_records)
    result = {
        "bench": "metering",
        "when": utc_now(),
        "rev": git_rev(),
        "machine": machine_info(),
        "ingest": ingest,
        "reports": reports,
    }
    path = write_result("metering", result)
    print(
        markdown_table(
            ["measure", "fedinfer", "baseline", "ratio", "target"],
            [
                [
                    "ingestion, records/s",
                    fmt(ingest["records_per_s"], 0),
                    fmt(ingest["orm_records_per_s"], 0) + " (ORM bulk_create)",
                    fmt(ingest["records_per_s"] / ingest["orm_records_per_s"]) + "x",
                    ">= 20,000",
                ],
                [
                    f"month report by tenant x day, {reports['month_records']:,} records, ms",
                    fmt(reports["report_ms"], 1),
                    fmt(reports["raw_report_ms"], 1) + " (from the raw records)",
                    fmt(reports["raw_report_ms"] / reports["report_ms"], 1) + "x faster",
                    "<= 300",
                ],
                [
                    "pool cost report, month by day, ms",
                    fmt(reports["pool_report_ms"], 1),
                    "",
                    "",
                    "",
                ],
                ["rollups of the month (720 hours), s", fmt(reports["rollup_s"], 1), "", "", ""],
            ],
        )
    )
    print(f"\nraw: {path}")
