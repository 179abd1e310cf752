"""The control plane's ingestion at fleet scale, on the real PostgreSQL and Redis: the database
half of the scale benchmark (``bench/scale.py`` calls :func:`heartbeat_rate` and
:func:`usage_rate`).

(a) **Heartbeats** (:func:`heartbeat_rate`): every edge reports every instance of its region,
    through the service the HTTP view calls (``telemetry.heartbeats.edge_heartbeat_record``),
    round-robin over the edges for a few seconds, in one or several processes. The fleet grows
    the cost of one heartbeat (instances per region, edges per instance's load snapshot), so
    the rate is measured per fleet size, against the floor of one row write per heartbeat (the
    edge's ``last_heartbeat_at``) in the same run. Target: >= 2,000 heartbeats/s per process.
(b) **Usage** (:func:`usage_rate`): records put into the usage stream exactly as edges ship
    them (entries of at most 1,000 records, each with its edge's MAC), then drained by one or
    several consumer processes through ``metering.stream.usage_stream_consume``, the worker's
    loop; every record must be stored exactly once. Target: the rate grows with consumers.

Run alone: ``python -m bench.scale_ingest --database-url ... --redis-url ...`` (its own
database ``<name>_fedbench``, dropped and created, and a flushed Redis db).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from itertools import zip_longest
from typing import Any

from bench.harness.control_plane import MODEL_SPEC, django_on_bench_database
from bench.harness.report import fmt, markdown_table, percentile

#: The heartbeat fleet's model, named apart from the one ``bench.metering.build_fleet``
#: registers, so the two halves run in either order in one database.
FLEET_MODEL: dict[str, Any] = {**MODEL_SPEC, "name": MODEL_SPEC["name"] + "-fleet"}
#: A shipped stream entry holds at most this many records (the edge's shipper batch).
ENTRY_RECORDS = 1_000

#: Work for one process: gets its share and the barrier its peers start at (None: alone).
Share = Callable[[Any, Any], dict[str, Any]]


def heartbeat_rate(
    *, regions: int, instances: int, edges: int, seconds: float = 5.0, processes: int = 1
) -> dict[str, Any]:
    """Heartbeats/s and instance reports/s of a fleet of this size, in ``processes``
    processes (a stride of the edges each), and the same number of one-row writes as the
    floor. Each call builds a fleet of its own beside the earlier ones."""
    t = time.perf_counter()
    plan = _heartbeat_fleet(regions, instances, edges)
    setup_s = time.perf_counter() - t
    shares = [plan[p::processes] for p in range(processes)]
    runs = _in_processes(lambda share, barrier: _heartbeats(share, seconds, barrier), shares)
    beats = sum(r["heartbeats"] for r in runs)
    latencies = [ms for r in runs for ms in r["latencies_ms"]]
    rate = sum(r["heartbeats"] / r["elapsed_s"] for r in runs)
    floor = sum(r["heartbeats"] / r["baseline_s"] for r in runs)
    return {
        "regions": regions,
        "instances": instances,
        "edges": edges,
        "processes": processes,
        "setup_s": setup_s,
        "reports_per_heartbeat": instances / regions,
        "heartbeats": beats,
        "heartbeats_per_s": rate,
        "heartbeats_per_s_per_process": rate / processes,
        "instance_reports_per_s": rate * instances / regions,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        # This process's own CPU (Python, the ORM): near the latency, the heartbeat is CPU-bound.
        "cpu_ms_per_heartbeat": 1000 * sum(r["cpu_s"] for r in runs) / beats,
        "row_writes_per_s": floor,
        "row_writes_per_s_per_process": floor / processes,
        "row_write_p50_ms": percentile([ms for r in runs for ms in r["baseline_ms"]], 50),
        "row_writes_per_heartbeat": floor / rate,
    }


def _heartbeat_fleet(regions: int, instances: int, edges: int) -> list[tuple[Any, list[Any]]]:
    """Regions, a pool and a deployment in each, ``instances`` ready instances and ``edges``
    edges dealt evenly over them, bulk-inserted (the services write an audit trail and an
    interval per instance: minutes for 10,000). Each instance's load already holds a fresh
    report of every edge of its region, the steady state the run then keeps up. Returns each
    edge with the reports its heartbeat sends: one per instance of its region."""
    from django.utils import timezone

    from federation.inventory.models import (
        AcceleratorType,
        Deployment,
        Edge,
        GPUPool,
        Instance,
        LanguageModel,
        Region,
    )
    from federation.telemetry.heartbeats import InstanceReport, merge_load

    now = timezone.now()
    tag = f"hb{Region.objects.count()}"  # grows with every fleet: names never collide
    model, _ = LanguageModel.objects.get_or_create(name=FLEET_MODEL["name"], defaults=FLEET_MODEL)
    h100 = AcceleratorType.objects.get(name="H100-80G")
    placed = [list(range(r, instances, regions)) for r in range(regions)]
    region_rows = Region.objects.bulk_create(
        Region(
            code=f"{tag}-r{r}",
            name=f"Region {r}",
            provider=Region.Provider.CLOUD,
            latitude=-60 + 120 * r / regions,
            longitude=-170 + 340 * r / regions,
            jurisdiction="US",
        )
        for r in range(regions)
    )
    pools = GPUPool.objects.bulk_create(
        GPUPool(
            region=region,
            name="h100",
            accelerator=h100,
            gpus_per_node=8,
            node_count=max(1, math.ceil(len(placed[r]) / 8)),
            interconnect=GPUPool.Interconnect.NVLINK,
            price_per_gpu_hour=Decimal("2.10"),
            capacity_type=GPUPool.CapacityType.ON_DEMAND,
        )
        for r, region in enumerate(region_rows)
    )
    deployments = Deployment.objects.bulk_create(
        Deployment(
            model=model,
            pool=pool,
            tensor_parallel_size=1,
            min_replicas=len(placed[r]),
            desired_replicas=len(placed[r]),
            max_replicas=len(placed[r]),
        )
        for r, pool in enumerate(pools)
    )
    edge_rows = Edge.objects.bulk_create(
        (
            Edge(
                region=region_rows[k % regions],
                name=f"{tag}-e{k}",
                url=f"http://{tag}-e{k}:8080",
                last_heartbeat_at=now,
            )
            for k in range(edges)
        ),
        batch_size=2_000,
    )
    # Each region's edges, with the index their reports are made from.
    local = [[(k, edge_rows[k].name) for k in range(r, edges, regions)] for r in range(regions)]

    def report(edge: int, instance: int) -> InstanceReport:
        # What an edge's heartbeat document says of an instance (``regions/edge/reports.py``).
        n = edge * 7 + instance
        load = {
            "in_flight": n % 13,
            "queued": n % 3,
            "kv_cache_usage": round((n % 97) / 100, 2),
            "tokens_per_s": 800.0 + n % 2_000,
            "overflow": n % 11 // 10,
        }
        return InstanceReport(id=f"{tag}-i{instance}", healthy=True, load=load)

    def steady(r: int, j: int) -> dict[str, Any]:
        if not local[r]:
            return {}
        *others, (last, name) = local[r]
        seen = {
            other: {**report(k, j).load, "healthy": True, "reported_at": now.isoformat()}
            for k, other in others
        }
        return merge_load({"edges": seen}, edge=name, report=report(last, j), now=now)

    Instance.objects.bulk_create(
        (
            Instance(
                deployment=deployments[r],
                name=f"{tag}-i{j}",
                endpoint_url=f"http://{tag}-i{j}:8000",
                state=Instance.State.READY,
                state_changed_at=now,
                last_heartbeat_at=now,
                load=steady(r, j),
            )
            for r in range(regions)
            for j in placed[r]
        ),
        batch_size=2_000,
    )
    return [(e, [report(k, j) for j in placed[k % regions]]) for k, e in enumerate(edge_rows)]


def _heartbeats(
    share: Sequence[tuple[Any, list[Any]]], seconds: float, barrier: Any
) -> dict[str, Any]:
    """Heartbeats round-robin over ``share`` for ``seconds``, then as many one-row liveness
    writes: the same process and connection, so the two are comparable."""
    from django.utils import timezone

    from federation.inventory.models import Edge
    from federation.telemetry.heartbeats import edge_heartbeat_record

    _start(barrier)
    latencies: list[float] = []
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    end = t0 + seconds
    while (t := time.perf_counter()) < end:
        edge, reports = share[len(latencies) % len(share)]
        edge_heartbeat_record(
            edge=edge, applied_table_version=None, instances=reports, budgets={}, cold={}
        )
        latencies.append((time.perf_counter() - t) * 1000)
    elapsed = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0
    _start(barrier)
    writes: list[float] = []
    t0 = time.perf_counter()
    for i in range(len(latencies)):
        t = time.perf_counter()
        Edge.objects.filter(pk=share[i % len(share)][0].pk).update(last_heartbeat_at=timezone.now())
        writes.append((time.perf_counter() - t) * 1000)
    return {
        "heartbeats": len(latencies),
        "elapsed_s": elapsed,
        "cpu_s": cpu_s,
        "latencies_ms": latencies,
        "baseline_s": time.perf_counter() - t0,
        "baseline_ms": writes,
    }


def usage_rate(*, consumers: int, records: int) -> dict[str, Any]:
    """Records/s through the worker's stream consumer with ``consumers`` processes; raises
    unless every record was stored exactly once and nothing went to the dead-letter."""
    import redis
    from django.conf import settings
    from django.db import connection

    from federation.metering.models import UsageDeadLetter, UsageRecord
    from regions.tables.usage import USAGE_STREAM

    client = redis.Redis.from_url(settings.REDIS_URL)
    senders = _usage_fleet()
    client.delete(USAGE_STREAM)  # with its consumer group: every call starts afresh
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {UsageRecord._meta.db_table}, {UsageDeadLetter._meta.db_table}")
    t = time.perf_counter()
    entries = _ship(settings.REDIS_URL, senders, records)
    ship_s = time.perf_counter() - t
    runs = _in_processes(_consume, [f"bench-{i}" for i in range(consumers)])
    stored = UsageRecord.objects.count()
    letters = UsageDeadLetter.objects.count()
    consumed = sum(r["records"] for r in runs)
    if stored != records or consumed != records or letters or client.xlen(USAGE_STREAM):
        raise RuntimeError(
            f"usage ingestion lost or doubled records: {records} shipped, {consumed} consumed, "
            f"{stored} stored, {letters} dead letters, {client.xlen(USAGE_STREAM)} left"
        )
    wall = max(r["elapsed_s"] for r in runs)
    return {
        "consumers": consumers,
        "records": records,
        "entries": entries,
        "ship_s": ship_s,
        "records_per_s": records / wall,
        "records_per_s_per_consumer": [r["records"] / r["elapsed_s"] for r in runs],
        "records_by_consumer": [r["records"] for r in runs],
    }


def _usage_fleet() -> dict[str, tuple[str, bytes]]:
    """The metering bench's fleet (pools, prices), the tenants its records name, and one edge
    per region with a known credential; region -> (edge, its stream MAC key). Built once."""
    from bench.metering import REGIONS, build_fleet
    from federation.inventory.models import Edge, Region
    from federation.tenancy.keys import EDGE_CREDENTIAL_PREFIX, hash_key
    from federation.tenancy.models import Tenant
    from regions.tables.usage import usage_stream_key

    credentials = {code: f"{EDGE_CREDENTIAL_PREFIX}bench-{code}" for code in REGIONS}
    if not Region.objects.filter(code=REGIONS[0]).exists():
        build_fleet()
        # The tenants ``bench.metering.documents`` names; any region may serve them.
        Tenant.objects.bulk_create(
            Tenant(slug=f"tenant-{i}", name=f"Tenant {i}") for i in range(200)
        )
        # Stored as ``routing.services.edge_credential_rotate`` stores a credential.
        Edge.objects.bulk_create(
            Edge(
                region=region,
                name=f"usage-{region.code}",
                url=f"http://usage-{region.code}:8080",
                credential_hash=hash_key(credentials[region.code]),
            )
            for region in Region.objects.filter(code__in=REGIONS)
        )
    return {
        code: (f"usage-{code}", usage_stream_key(credential))
        for code, credential in credentials.items()
    }


def _ship(url: str, senders: dict[str, tuple[str, bytes]], records: int) -> int:
    """``records`` of ``bench.metering.documents``, each signed for (``edge``) and shipped by
    the edge of its region, in entries of at most 1,000 appended by the edge's own sink; the
    entries of the regions interleaved, as many edges ship at once. Returns the entries."""
    import msgspec

    from bench.metering import documents
    from regions.edge.metering.usage_shipper import RedisStreamSink
    from regions.tables.usage import decode_record, encode_record

    start = time.time() - records * 0.01 - 60  # documents() spaces records 10 ms apart
    by_region: dict[str, list[bytes]] = {code: [] for code in senders}
    for document in documents(records, datetime.fromtimestamp(start, tz=UTC)):
        record = decode_record(document)
        signed = msgspec.structs.replace(record, edge=senders[record.region][0])
        by_region[record.region].append(encode_record(signed) + b"\n")
    chunks = [
        [
            (code, b"".join(lines[i : i + ENTRY_RECORDS]))
            for i in range(0, len(lines), ENTRY_RECORDS)
        ]
        for code, lines in by_region.items()
    ]
    batches = [batch for turn in zip_longest(*chunks) for batch in turn if batch is not None]

    async def ship() -> None:
        sinks = {
            code: RedisStreamSink(url, edge=edge, key=key) for code, (edge, key) in senders.items()
        }
        for code, data in batches:
            await sinks[code].send(data)
        for sink in sinks.values():
            await sink.close()

    asyncio.run(ship())
    return len(batches)


def _consume(name: str, barrier: Any) -> dict[str, Any]:
    """The worker's loop as consumer ``name``, until the stream has nothing more for it."""
    import redis
    from django.conf import settings

    from federation.metering.stream import usage_stream_consume

    client = redis.Redis.from_url(settings.REDIS_URL)
    _start(barrier)
    t0 = time.perf_counter()
    records = 0
    while (result := usage_stream_consume(client, consumer=name)).batches:
        records += result.records
        if result.rejected:
            raise RuntimeError(f"consumer {name}: {result.rejected} records refused")
    return {"consumer": name, "records": records, "elapsed_s": time.perf_counter() - t0}


def _start(barrier: Any) -> None:
    """Wait for the peer processes, so that the measured phases overlap."""
    if barrier is not None:
        barrier.wait()


def _in_processes(work: Share, shares: Sequence[Any]) -> list[dict[str, Any]]:
    """``work`` on each share, each in a forked process of its own starting together (one
    share: in this process); their results, in order. Django's connections are closed before
    the fork, so each child opens its own."""
    if len(shares) == 1:
        return [work(shares[0], None)]
    from django.db import connections

    connections.close_all()
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(shares))
    results = ctx.Queue()

    def child(index: int, share: Any) -> None:
        try:
            results.put((index, work(share, barrier), None))
        except Exception as exc:  # reported to the parent, which raises it
            barrier.abort()
            results.put((index, None, repr(exc)))
        finally:
            connections.close_all()

    procs = [ctx.Process(target=child, args=(i, s)) for i, s in enumerate(shares)]
    for proc in procs:
        proc.start()
    out: dict[int, dict[str, Any]] = {}
    for _ in procs:
        index, result, error = results.get()
        if error is not None:
            raise RuntimeError(f"process {index} failed: {error}")
        out[index] = result
    for proc in procs:
        proc.join()
    return [out[i] for i in range(len(shares))]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    """Both measurements on a fresh bench database; the tables as ``bench/scale.py`` reports."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fedinfer"),
    )
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/6")
    )
    parser.add_argument("--regions", type=int, default=13)
    parser.add_argument("--instances", type=int, default=1_250)
    parser.add_argument("--edges", type=int, default=125)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--processes", type=_ints, default=[1, 2])
    parser.add_argument("--consumers", type=_ints, default=[1, 2])
    parser.add_argument("--records", type=int, default=20_000)
    args = parser.parse_args(argv)
    django_on_bench_database(args.database_url, args.redis_url)
    beats = [
        heartbeat_rate(
            regions=args.regions,
            instances=args.instances,
            edges=args.edges,
            seconds=args.seconds,
            processes=p,
        )
        for p in args.processes
    ]
    usage = [usage_rate(consumers=c, records=args.records) for c in args.consumers]
    print(
        f"heartbeats: {args.regions} regions, {args.instances} instances, {args.edges} edges "
        f"({beats[0]['reports_per_heartbeat']:.0f} reports a heartbeat), "
        f"set-up {fmt(beats[0]['setup_s'], 1)} s"
    )
    print(
        markdown_table(
            [
                "processes",
                "heartbeats/s",
                "per process",
                "reports/s",
                "p50 ms",
                "p99 ms",
                "CPU ms",
                "row writes/s (floor)",
                "heartbeat / row write",
            ],
            [
                [
                    b["processes"],
                    fmt(b["heartbeats_per_s"], 0),
                    fmt(b["heartbeats_per_s_per_process"], 0),
                    fmt(b["instance_reports_per_s"], 0),
                    fmt(b["p50_ms"]),
                    fmt(b["p99_ms"]),
                    fmt(b["cpu_ms_per_heartbeat"]),
                    fmt(b["row_writes_per_s"], 0),
                    fmt(b["row_writes_per_heartbeat"], 1),
                ]
                for b in beats
            ],
        )
    )
    print(f"\nusage: {args.records:,} records in {usage[0]['entries']} stream entries")
    print(
        markdown_table(
            ["consumers", "records/s", "per consumer"],
            [
                [
                    u["consumers"],
                    fmt(u["records_per_s"], 0),
                    ", ".join(fmt(r, 0) for r in u["records_per_s_per_consumer"]),
                ]
                for u in usage
            ],
        )
    )


if __name__ == "__main__":
    main()
