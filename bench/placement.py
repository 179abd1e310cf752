"""The placement planner's solve time on a synthetic fleet (pure: no database, no processes).

    python -m bench.placement [--regions 30] [--models 20] [--seed 1]

Three pools per region (H100/NVLink, A100/NVLink, L40S/PCIe; 2-8 nodes of 8 GPUs), models of
1-70B, demand from half the (region, model) pairs for an "any region" class and from a
third of the regions for an EU-only class, regions placed at random on a map with links
between those within reach (RTT from the distance). Measured: the first plan (nothing runs),
then re-plans against it with demand x 0.95, 1.05 and 1.3: time, HiGHS status and gap, cost,
replicas changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random

from bench.harness.report import markdown_table, utc_now, write_result
from federation.fleet import placement_types as P
from federation.fleet.placement import plan_placement
from federation.inventory import fit

ACCELERATORS = (
    # name, GiB, relative speed, USD per GPU-hour, interconnect
    ("H100-80G", 80, 1.0, 3.5, "nvlink"),
    ("A100-80G", 80, 0.6, 2.0, "nvlink"),
    ("L40S-48G", 48, 0.45, 1.2, "pcie"),
)


def synthetic_fleet(regions: int, models: int, seed: int) -> P.PlacementInput:
    """A seeded fleet and demand of the given size: the same input for every run."""
    rnd = random.Random(seed)
    codes = [f"r{r:02d}" for r in range(regions)]
    pools = [
        P.PoolOffer(
            key=f"{code}/{name.lower()}",
            region=code,
            spec=fit.PoolSpec(name, name, mem, 8, rnd.randint(2, 8), ic, False, 0.9),
            relative_speed=speed,
            price_per_gpu_hour=price * rnd.uniform(0.8, 1.2),
        )
        for code in codes
        for name, mem, speed, price, ic in ACCELERATORS
    ]
    planned = []
    for i in range(models):
        b = rnd.choice([1, 3, 8, 14, 32, 70])
        spec = fit.ModelSpec(f"m{i}", b * 1.86, 8192, 32 if b < 30 else 80, 64, 8, 128)
        planned.append(P.PlannedModel(f"m{i}", spec, float(b)))
    eu = frozenset(codes[::3])
    classes = {"any": frozenset(codes), "eu": eu}
    demand = []
    for code in codes:
        for m in planned:
            if rnd.random() < 0.5:
                demand.append(P.Demand("any", code, m.name, rnd.uniform(50, 3000)))
            if code in eu and rnd.random() < 0.5:
                demand.append(P.Demand("eu", code, m.name, rnd.uniform(50, 2000)))
    where = {c: (rnd.uniform(-60, 60), rnd.uniform(-180, 180)) for c in codes}
    rtt = {
        (a, b): 5 + 1.2 * math.dist(where[a], where[b])
        for a in codes
        for b in codes
        if a != b and math.dist(where[a], where[b]) < 120
    }
    return P.PlacementInput(pools, planned, demand, classes, rtt_ms=rtt)


def main(argv: list[str]) -> None:
    """Plan, then re-plan with the demand scaled; print and write the result."""
    parser = argparse.ArgumentParser(prog="python -m bench.placement")
    parser.add_argument("--regions", type=int, default=30)
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    data = synthetic_fleet(args.regions, args.models, args.seed)
    rows, results = [], []
    first = plan_placement(data)
    current = [
        P.Current(p.model, p.pool, p.tensor_parallel_size, p.after)
        for p in first.placements
        if p.after
    ]
    runs = [("first plan", first)]
    for factor in (0.95, 1.05, 1.3):
        scaled = [dataclasses.replace(d, tokens_per_s=d.tokens_per_s * factor) for d in data.demand]
        again = dataclasses.replace(data, demand=scaled, current=current)
        runs.append((f"demand x {factor}", plan_placement(again)))
    for name, plan in runs:
        rows.append(
            (
                name,
                f"{plan.solve_s:.1f}",
                plan.status,
                f"{plan.gap:.1%}",
                f"{plan.usd_per_hour_after:.0f}",
                plan.gpus_after,
                plan.changes,
                f"{sum(u.tokens_per_s for u in plan.unserved):.0f}",
            )
        )
        results.append(
            {
                "run": name,
                "solve_s": plan.solve_s,
                "status": plan.status,
                "gap": plan.gap,
                "usd_per_hour": plan.usd_per_hour_after,
                "gpus": plan.gpus_after,
                "changes": plan.changes,
            }
        )
    print(f"{args.regions} regions x {args.models} models x 3 pools, {len(data.demand)} demands")
    header = (
        "run",
        "solve s",
        "status",
        "gap",
        "USD/h",
        "GPUs",
        "replicas changed",
        "unserved tok/s",
    )
    print(markdown_table(header, rows))
    write_result("placement", {"at": utc_now(), "args": vars(args), "runs": results})


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
