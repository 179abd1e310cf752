"""Compile-time benchmark of the routing tables: a seeded synthetic fleet of 30
regions, 300 GPU pools, 200 models and 5,000 tenants; time to compile all 30 tables, demand
split (HiGHS) included, median of repeated runs. Target: < 2 s.

    .venv/bin/python -m bench.compile_tables [--runs 3] [--seed 7] [--regions 30] ...

Pure: no database, no network. Prints a Markdown table and writes ``var/bench/compile-tables-*``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import random
import subprocess
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson

from bench.harness.report import markdown_table, spread, utc_now, write_result
from regions.tables.signing import sign, verify

if TYPE_CHECKING:
    from federation.routing.snapshot import FleetSnapshot

JURISDICTIONS = ("US", "EU", "UK", "APAC", "IN", "CA", "LATAM", "MEA")
#: (name, relative speed, memory GiB, USD per GPU-hour)
ACCELERATORS = (
    ("H100-80G", 1.0, 80, 2.49),
    ("H200-141G", 1.25, 141, 3.40),
    ("A100-80G", 0.55, 80, 1.79),
    ("L40S-48G", 0.45, 48, 0.95),
    ("L4-24G", 0.14, 24, 0.32),
    ("MI300X-192G", 1.1, 192, 2.20),
)
SIZES_B = (1.0, 3.0, 8.0, 14.0, 32.0, 70.0)


def setup_django() -> None:
    """Django set up before the compiler is imported: its imports reach DRF's settings
    (``federation.core.metrics``), which fail outside a configured project. No database opens."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")
    import django

    django.setup()


def synthetic_fleet(
    *,
    seed: int,
    regions: int,
    pools: int,
    models: int,
    tenants: int,
    models_per_pool: int,
    demand_load: float,
) -> FleetSnapshot:
    """A plausible fleet: regions spread over the globe (RTT from distance), pools of mixed
    accelerators and prices, models of mixed sizes with adapters, tenants with the residency
    policies seen in practice, demand for the popular models at ``demand_load`` of capacity."""
    from federation.routing.compiler import replica_tokens_per_s
    from federation.routing.snapshot import (
        FleetSnapshot,
        InstanceRow,
        KeyRow,
        RegionRow,
        TenantRow,
    )
    from federation.tenancy.residency import ResidencyPolicy

    rng = random.Random(seed)
    codes = [f"r{i:02d}" for i in range(regions)]
    where = {c: (rng.uniform(-50, 60), rng.uniform(-180, 180)) for c in codes}
    evacuated = set(rng.sample(codes, max(1, regions // 15)))
    region_rows = tuple(
        RegionRow(
            c,
            "evacuated" if c in evacuated else "active",
            JURISDICTIONS[i % len(JURISDICTIONS)],
            f"http://edge-{c}.example:8080",
        )
        for i, c in enumerate(codes)
    )
    rtt: dict[tuple[str, str], float] = {}
    for a in codes:
        for b in codes:
            if a < b:
                (la, lo), (lb, lob) = where[a], where[b]
                km = 111.0 * math.hypot(la - lb, (lo - lob) * math.cos(math.radians(la)))
                rtt[(a, b)] = round(5.0 + km / 100.0, 1)  # ~2/3 c in fibre, there and back
    model_names = [f"org{i % 17}/model-{i:03d}" for i in range(models)]
    params = {m: rng.choice(SIZES_B) for m in model_names}
    adapters = {
        m: tuple(f"{m.split('/')[1]}-lora-{j}" for j in range(rng.choice((0, 0, 1, 2, 3))))
        for m in model_names
    }
    popularity = {m: rng.paretovariate(1.2) for m in model_names}
    instances: list[InstanceRow] = []
    for p in range(pools):
        region = codes[p % regions]
        acc, speed, _, price = rng.choice(ACCELERATORS)
        price *= rng.uniform(0.8, 1.25)
        chosen = rng.choices(model_names, weights=list(popularity.values()), k=models_per_pool)
        for k, m in enumerate(dict.fromkeys(chosen)):
            tp = 1 if params[m] <= 14 else (2 if params[m] <= 32 else 4)
            for r in range(rng.randint(1, 3)):
                instances.append(
                    InstanceRow(
                        name=f"{region}-p{p}-{k}-{r}",
                        endpoint_url=f"http://10.{p // 256}.{p % 256}.{k * 4 + r}:8000",
                        state="ready" if rng.random() > 0.08 else "draining",
                        region=region,
                        model=m,
                        role="mixed",
                        accelerator=acc,
                        relative_speed=speed,
                        tensor_parallel_size=tp,
                        parameter_count_b=params[m],
                        max_num_seqs=rng.choice((64, 128, 256)),
                        adapters=adapters[m],
                        price_per_gpu_hour=round(price, 4),
                    )
                )
    capacity: dict[str, float] = {}
    for row in instances:
        if row.state == "ready" and row.region not in evacuated:
            capacity[row.model] = capacity.get(row.model, 0.0) + replica_tokens_per_s(
                relative_speed=row.relative_speed,
                tensor_parallel_size=row.tensor_parallel_size,
                params_b=row.parameter_count_b,
            )
    # Demand: each model's fleet capacity times the load, spread over a random third of the
    # origins (skewed), plus a little adapter traffic.
    demand: dict[tuple[str, str], float] = {}
    for m, cap in sorted(capacity.items()):
        origins = rng.sample(codes, max(1, regions // 3))
        shares = [rng.random() ** 2 + 0.05 for _ in origins]
        for o, s in zip(origins, shares, strict=True):
            demand[(o, m)] = round(cap * demand_load * s / sum(shares), 1)
            for a in adapters[m][:1]:
                demand[(o, a)] = round(demand[(o, m)] * 0.1, 1)
    now = datetime(2026, 11, 29, tzinfo=UTC)
    tenant_rows = []
    for t in range(tenants):
        kind = rng.random()
        if kind < 0.4:
            policy = ResidencyPolicy()
        elif kind < 0.8:
            policy = ResidencyPolicy.of([rng.choice(JURISDICTIONS)])
        elif kind < 0.95:
            policy = ResidencyPolicy.of(rng.sample(JURISDICTIONS, 2))
        else:
            j = rng.choice(JURISDICTIONS)
            in_j = [r.code for r in region_rows if r.jurisdiction == j]
            policy = ResidencyPolicy.of([j], rng.sample(in_j, rng.randint(1, len(in_j))))
        keys = tuple(
            KeyRow(
                rng.randbytes(32).hex(),
                now + timedelta(days=rng.randint(1, 400)) if rng.random() < 0.3 else None,
            )
            for _ in range(rng.choice((1, 1, 2)))
        )
        rpm = rng.choice((None, 60, 600, 6000))
        tenant_rows.append(
            TenantRow(
                slug=f"tenant-{t:05d}",
                policy=policy,
                requests_per_minute=rpm,
                tokens_per_minute=None if rpm is None else rpm * 2000,
                monthly_budget_usd=rng.choice((None, 500.0, 5000.0)),
                spend_usd=rng.uniform(0, 6000),
                keys=keys,
            )
        )
    return FleetSnapshot(
        regions=region_rows,
        instances=tuple(instances),
        rtt_ms=rtt,
        tenants=tuple(tenant_rows),
        demand_tokens_per_s=demand,
    )


def compile_all(snapshot: FleetSnapshot, *, key: str) -> dict[str, Any]:
    """One full compile: the plan, every region's document, then signing each (canonical
    JSON + HMAC). Wall and CPU time per phase: the machine is shared, and CPU time is what
    contention changes least."""
    from federation.routing.compiler import compile_region_table, fleet_plan

    w0, c0 = time.perf_counter(), time.process_time()
    plan = fleet_plan(snapshot)
    w1, c1 = time.perf_counter(), time.process_time()
    docs = {
        r.code: compile_region_table(
            snapshot, region=r.code, version=1, generated_at="2026-11-29T10:00:00Z", plan=plan
        )
        for r in snapshot.regions
    }
    w2, c2 = time.perf_counter(), time.process_time()
    signed = {code: sign(doc, key, "k1") for code, doc in docs.items()}
    w3, c3 = time.perf_counter(), time.process_time()
    return {
        "plan_s": w1 - w0,
        "documents_s": w2 - w1,
        "compile_s": w2 - w0,
        "sign_s": w3 - w2,
        "total_s": w3 - w0,
        "plan_cpu_s": c1 - c0,
        "compile_cpu_s": c2 - c0,
        "total_cpu_s": c3 - c0,
        "lp_variables": plan.split.variables,
        "classes": len(plan.classes),
        "unserved_tokens_per_s": sum(plan.split.origin_unserved.values()),
        "demand_tokens_per_s": sum(plan.demand.values()),
        "signed": signed,
    }


def main(argv: list[str]) -> None:
    """Compile the synthetic fleet ``--runs`` times; print and write the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--regions", type=int, default=30)
    parser.add_argument("--pools", type=int, default=300)
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--tenants", type=int, default=5000)
    parser.add_argument("--models-per-pool", type=int, default=4)
    parser.add_argument(
        "--demand-load",
        type=float,
        default=0.55,
        help="fleet demand as a share of raw capacity (capacity target 0.65)",
    )
    args = parser.parse_args(argv)
    setup_django()
    load_before = os.getloadavg()[0]
    t = time.perf_counter()
    snapshot = synthetic_fleet(
        seed=args.seed,
        regions=args.regions,
        pools=args.pools,
        models=args.models,
        tenants=args.tenants,
        models_per_pool=args.models_per_pool,
        demand_load=args.demand_load,
    )
    build_s = time.perf_counter() - t
    runs = []
    for _ in range(args.runs):
        gc.collect()
        runs.append(compile_all(snapshot, key="bench-signing-key"))
    # The output is what the edge accepts: every document verifies and decodes.
    signed = runs[-1]["signed"]
    size = 0
    for code, doc in signed.items():
        body = orjson.dumps(doc)
        size += len(body)
        assert verify(body, {"k1": "bench-signing-key"}).region == code
    for r in runs:
        r.pop("signed")
    ready = sum(1 for i in snapshot.instances if i.state == "ready")
    rows = [
        [
            name,
            *(f"{spread([r[key] for r in runs])[s] * 1000:.0f}" for s in ("median", "min", "max")),
        ]
        for name, key in (
            ("fleet plan (capacities, classes, demand split LP, tenants)", "plan_s"),
            ("region documents", "documents_s"),
            ("**compile, all regions** (plan + documents)", "compile_s"),
            ("sign all (canonical JSON + HMAC-SHA256)", "sign_s"),
            ("compile + sign", "total_s"),
            ("compile, CPU time", "compile_cpu_s"),
            ("compile + sign, CPU time", "total_cpu_s"),
        )
    ]
    print(
        f"fleet: {len(snapshot.regions)} regions, {args.pools} pools, {args.models} models, "
        f"{len(snapshot.tenants)} tenants, {ready} ready instances, "
        f"{len(snapshot.demand_tokens_per_s)} demand pairs; built in {build_s:.1f} s\n"
        f"LP: {runs[0]['lp_variables']} variables, {runs[0]['classes']} residency classes; "
        f"demand {runs[0]['demand_tokens_per_s'] / 1e6:.2f} M tokens/s, of which "
        f"{runs[0]['unserved_tokens_per_s'] / 1e6:.2f} M unservable (residency or capacity); "
        f"signed tables {size / 1e6:.1f} MB in all\n"
    )
    print(markdown_table(["phase", "median ms", "min ms", "max ms"], rows))
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    path = write_result(
        "compile-tables",
        {
            "when": utc_now(),
            "git": rev,
            "python": platform.python_version(),
            "nproc": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg()[0],
            "args": vars(args),
            "instances_ready": ready,
            "signed_bytes": size,
            "runs": runs,
        },
    )
    print(f"\nload average {load_before:.2f} -> {os.getloadavg()[0]:.2f}; raw: {path}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
