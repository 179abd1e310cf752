"""The control plane's growth (`python -m bench scale`): what one change costs as the fleet grows.

A synthetic fleet (``bench.compile_tables.synthetic_fleet``: regions over the globe, pools of
mixed accelerators, models with adapters, tenants with the residency policies seen in
practice) at steps of a base — by default 1x, 2x, 4x, 8x of 13 regions, 1,250 instances,
12,500 tenants, 125 edges and 25 models, so the last step has 104 regions, 10,000 instances,
100,000 tenants and 1,000 edges. Per step, the compile half (pure, no database):

* **full compile**: the fleet plan and every region's document, as ``routing_tables_publish``
  builds them;
* **one instance's change**: one ready instance starts draining; what the publisher does for it
  today (a new plan, every region's document, each hashed to find those that changed), and how
  many regions' tables changed;
* **table size**: each region's signed document (canonical JSON, what an edge downloads);
* **what edges receive per change**: every edge of a changed region downloads its whole table:
  the bytes per edge and in all; and the CPU the control plane spends serving them: each web
  process reads a new version back, signs it and keeps the bytes for the region's other edges
  (``distribution.routing_table_latest_signed``), so once per changed region and process.

With ``--database-url`` (and ``--redis-url``) the database half runs too, from
``bench.scale_ingest``: heartbeat ingestion per second per process and usage ingestion with one
and several consumers, on a fresh ``<db>_fedbench`` database.

Targets (issue 28): one instance's change costs the same at 8x as at 1x (within 2x); an edge
receives a change in at most 1 s at 1,000 edges; heartbeat ingestion at least 2,000 per second
per process; usage ingestion grows with consumers. JSON under ``var/bench/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson

from bench.compile_tables import setup_django, synthetic_fleet
from bench.harness.procs import git_rev, machine_info
from bench.harness.report import fmt, markdown_table, utc_now, write_result

if TYPE_CHECKING:
    from federation.routing.compiler import FleetPlan
    from federation.routing.snapshot import FleetSnapshot
    from federation.routing.tenant_plan import TenantPlan

#: The 1x step: 8x reaches the issue's 100 regions, 10,000 instances, 100,000 tenants and
#: 1,000 edges.
BASE = {"regions": 13, "instances": 1250, "tenants": 12_500, "edges": 125, "models": 25}
#: Instances a synthetic pool holds on average (up to 4 models, 1-3 replicas each).
INSTANCES_PER_POOL = 6.0
SIGNING_KEY = "bench-signing-key"
GENERATED_AT = "2026-11-29T10:00:00Z"


@dataclasses.dataclass(frozen=True)
class Step:
    factor: int
    regions: int
    instances: int
    tenants: int
    edges: int
    models: int

    @classmethod
    def of(cls, factor: int, base: dict[str, int]) -> Step:
        return cls(factor, **{k: v * factor for k, v in base.items()})


def fleet_at(step: Step, seed: int) -> FleetSnapshot:
    """The step's fleet, its edges spread evenly over the regions (they lease budgets and share
    rate limits, so they are in the tables too)."""
    snapshot = synthetic_fleet(
        seed=seed,
        regions=step.regions,
        pools=max(1, round(step.instances / INSTANCES_PER_POOL)),
        models=step.models,
        tenants=step.tenants,
        models_per_pool=4,
        demand_load=0.55,
    )
    per_region = [step.edges // step.regions] * step.regions
    for i in range(step.edges % step.regions):
        per_region[i] += 1
    regions = tuple(
        dataclasses.replace(r, edges=tuple(f"edge-{r.code}-{j}" for j in range(n)))
        for r, n in zip(snapshot.regions, per_region, strict=True)
    )
    return dataclasses.replace(snapshot, regions=regions)


def one_instance_drains(snapshot: FleetSnapshot) -> tuple[FleetSnapshot, str]:
    """The same fleet with its first ready instance of an active region draining."""
    active = {r.code for r in snapshot.regions if r.status == "active"}
    i, row = next(
        (i, r)
        for i, r in enumerate(snapshot.instances)
        if r.state == "ready" and r.region in active
    )
    instances = list(snapshot.instances)
    instances[i] = dataclasses.replace(row, state="draining")
    return dataclasses.replace(snapshot, instances=tuple(instances)), row.region


def publish(
    snapshot: FleetSnapshot, latest: Mapping[str, tuple[int, str | None]], reuse: TenantPlan | None
) -> tuple[FleetPlan, dict[str, str], float, float]:
    """What ``routing_tables_publish`` computes, without the database: the plan and the
    documents whose body changed (``compile_changed_tables``). (plan, region -> new body hash,
    wall s, CPU s)."""
    from federation.routing.changed_tables import compile_changed_tables
    from federation.routing.services import without_cyclic_gc

    gc.collect()
    w, c = time.perf_counter(), time.process_time()
    with without_cyclic_gc():
        plan, changed = compile_changed_tables(
            snapshot, latest=latest, generated_at=GENERATED_AT, reuse=reuse
        )
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    return plan, {t.region: t.body_hash for t in changed}, wall, cpu


def serve_cost(snapshot: FleetSnapshot, plan: FleetPlan, region: str) -> tuple[int, float]:
    """The first fetch of ``region``'s new table in a web process: the stored document read
    back (JSON decode) and signed (canonical JSON + HMAC); the region's other edges get the
    same bytes. (bytes sent, CPU s)."""
    from federation.routing.compiler import compile_region_table
    from regions.tables.signing import sign

    stored = orjson.dumps(
        compile_region_table(
            snapshot, region=region, version=2, generated_at=GENERATED_AT, plan=plan
        )
    )
    c = time.process_time()
    body = orjson.dumps(sign(orjson.loads(stored), SIGNING_KEY, "k1"))
    return len(body), time.process_time() - c


def measure_step(step: Step, *, seed: int, runs: int) -> dict[str, Any]:
    """The compile half of one step (module docstring)."""
    t = time.perf_counter()
    before = fleet_at(step, seed)
    built_s = time.perf_counter() - t
    after, changed_region = one_instance_drains(before)
    never = {r.code: (0, None) for r in before.regions}
    full, cold, warm = [], [], []
    for _ in range(runs):
        plan, hashes, wall, cpu = publish(before, never, None)
        full.append((wall, cpu))
        latest = {code: (1, digest) for code, digest in hashes.items()}
        # A publisher process's first compile (nothing to reuse), then one that compiled the
        # fleet before the change (the product's worker, from its second publish on).
        *_, wall, cpu = publish(after, latest, None)
        cold.append((wall, cpu))
        plan_after, new, wall, cpu = publish(after, latest, plan.tenant_plan)
        warm.append((wall, cpu))
    changed = sorted(new)
    edges_of = {r.code: len(r.edges) for r in before.regions}
    sizes: dict[str, int] = {}
    serve_cpu: dict[str, float] = {}
    for r in before.regions:
        sizes[r.code], serve_cpu[r.code] = serve_cost(after, plan_after, r.code)
    receivers = sum(edges_of[c] for c in changed)
    ready = sum(1 for i in before.instances if i.state == "ready")
    return {
        "factor": step.factor,
        "regions": step.regions,
        "instances": len(before.instances),
        "instances_ready": ready,
        "tenants": len(before.tenants),
        "edges": sum(edges_of.values()),
        "models": step.models,
        "built_s": built_s,
        "lp_variables": plan.split.variables,
        "full_compile_s": statistics.median(w for w, _ in full),
        "full_compile_cpu_s": statistics.median(c for _, c in full),
        "change_cold_s": statistics.median(w for w, _ in cold),
        "change_cold_cpu_s": statistics.median(c for _, c in cold),
        "change_compile_s": statistics.median(w for w, _ in warm),
        "change_compile_cpu_s": statistics.median(c for _, c in warm),
        "changed_region": changed_region,
        "regions_changed": len(changed),
        "table_bytes_median": statistics.median(sizes.values()),
        "table_bytes_max": max(sizes.values()),
        "edges_receiving": receivers,
        "bytes_per_receiving_edge": (
            sum(sizes[c] * edges_of[c] for c in changed) / receivers if receivers else 0
        ),
        "bytes_sent_per_change": sum(sizes[c] * edges_of[c] for c in changed),
        "serve_cpu_per_fetch_s": statistics.median(serve_cpu.values()),
        "serve_cpu_per_change_s": sum(serve_cpu[c] for c in changed),
    }


def compile_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """One row per step: the fleet, then what a full compile and one change cost."""
    first = results[0]
    rows = []
    for r in results:
        rows.append(
            [
                f"{r['factor']}x",
                f"{r['regions']} / {r['instances']:,} / {r['tenants']:,} / {r['edges']:,}",
                fmt(r["full_compile_s"], 2),
                fmt(r["change_cold_s"], 2),
                fmt(r["change_compile_s"], 2),
                fmt(r["change_compile_cpu_s"] / first["change_compile_cpu_s"], 1),
                f"{r['regions_changed']} of {r['regions']}",
                f"{r['table_bytes_median'] / 1e6:.1f} / {r['table_bytes_max'] / 1e6:.1f}",
                f"{r['edges_receiving']:,}",
                f"{r['bytes_sent_per_change'] / 1e9:.2f}",
                fmt(r["serve_cpu_per_change_s"], 1),
            ]
        )
    return rows


COMPILE_HEADER = [
    "step",
    "regions / instances / tenants / edges",
    "full compile s",
    "one change: first compile s",
    "one change: compile s",
    "its CPU vs 1x",
    "tables changed",
    "table MB (median / max)",
    "edges receiving",
    "GB sent",
    "serving CPU s",
]


def measure_ingest(steps: list[Step], *, seconds: float, records: int) -> dict[str, Any]:
    """The database half: heartbeats per step (the fleet sets what one heartbeat carries and
    locks), and usage with one and two consumers (the fleet does not change a record's cost)."""
    from bench.scale_ingest import heartbeat_rate, usage_rate

    beats = [
        heartbeat_rate(
            regions=s.regions, instances=s.instances, edges=s.edges, seconds=seconds, processes=1
        )
        for s in steps
    ]
    usage = [usage_rate(consumers=n, records=records) for n in (1, 2)]
    rows = [
        [
            f"{s.factor}x",
            f"{b['reports_per_heartbeat']:.0f}",
            fmt(b["heartbeats_per_s_per_process"], 1),
            fmt(b["p50_ms"], 0),
            fmt(b["row_writes_per_s_per_process"], 0),
        ]
        for s, b in zip(steps, beats, strict=True)
    ]
    worst = min(b["heartbeats_per_s_per_process"] for b in beats)
    grows = usage[1]["records_per_s"] / usage[0]["records_per_s"]
    table = markdown_table(
        [
            "step",
            "instances per heartbeat",
            "heartbeats/s, one process",
            "p50 ms",
            "one-row writes/s (floor)",
        ],
        rows,
    )
    table += (
        f"\n\nusage: {usage[0]['records_per_s']:,.0f} records/s with one consumer, "
        f"{usage[1]['records_per_s']:,.0f} with two ({grows:.2f}x), {records:,} records each"
    )
    return {
        "heartbeats": beats,
        "usage": usage,
        "table": table,
        "judged": {
            "heartbeat ingestion per process (target >= 2,000/s)": f"{worst:.1f}/s: "
            + ("met" if worst >= 2000 else "NOT met"),
            "usage ingestion with two consumers (target: grows)": f"{grows:.2f}x one's: "
            + ("met" if grows > 1.1 else "NOT met"),
        },
    }


def judge(results: list[dict[str, Any]], ingest: dict[str, Any] | None) -> list[str]:
    """The issue's targets, each met or not, from this run's figures."""
    first, last = results[0], results[-1]
    ratio = last["change_compile_cpu_s"] / first["change_compile_cpu_s"]
    lines = [
        f"- one instance's change at {last['factor']}x costs {ratio:.1f}x its CPU at 1x "
        f"(target <= 2x): {'met' if ratio <= 2 else 'NOT met'}",
        f"- an edge receives a change at {last['edges']:,} edges after at least "
        f"{last['change_compile_s'] + last['serve_cpu_per_change_s']:.1f} s of one process's "
        f"compile and serving CPU (target <= 1 s): "
        f"{'met' if last['change_compile_s'] + last['serve_cpu_per_change_s'] <= 1 else 'NOT met'}",
    ]
    if ingest is not None:
        for key, value in ingest.get("judged", {}).items():
            lines.append(f"- {key}: {value}")
    return lines


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1,2,4,8", help="factors of the base fleet")
    parser.add_argument("--runs", type=int, default=1, help="compiles per step (median)")
    parser.add_argument("--seed", type=int, default=7)
    for key, value in BASE.items():
        parser.add_argument(f"--base-{key}", type=int, default=value)
    parser.add_argument("--database-url", help="also run the database half on <db>_fedbench")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--ingest-seconds", type=float, default=5.0)
    parser.add_argument("--usage-records", type=int, default=40_000)
    args = parser.parse_args(argv)
    base = {k: getattr(args, f"base_{k}") for k in BASE}
    steps = [Step.of(int(f), base) for f in args.steps.split(",")]
    load_before = os.getloadavg()[0]
    if args.database_url:
        from bench.harness.control_plane import django_on_bench_database

        django_on_bench_database(args.database_url, args.redis_url)
    else:
        setup_django()
    results = []
    for step in steps:
        result = measure_step(step, seed=args.seed, runs=args.runs)
        results.append(result)
        print(
            f"{step.factor}x: {result['regions']} regions, {result['instances']:,} instances, "
            f"{result['tenants']:,} tenants: full {result['full_compile_s']:.2f} s, change "
            f"{result['change_compile_s']:.2f} s, tables {result['table_bytes_median'] / 1e6:.1f}"
            f" MB, {result['edges_receiving']} edges receive "
            f"{result['bytes_sent_per_change'] / 1e9:.2f} GB",
            flush=True,
        )
    ingest = (
        measure_ingest(steps, seconds=args.ingest_seconds, records=args.usage_records)
        if args.database_url
        else None
    )
    print()
    print(markdown_table(COMPILE_HEADER, compile_rows(results)))
    if ingest is not None:
        print()
        print(ingest["table"])
    print()
    print("\n".join(judge(results, ingest)))
    path = write_result(
        "scale",
        {
            "when": utc_now(),
            "git": git_rev(),
            "machine": machine_info(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg()[0],
            "args": vars(args),
            "steps": results,
            "ingest": None if ingest is None else {k: v for k, v in ingest.items() if k != "table"},
        },
    )
    print(f"\nraw: {path}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
