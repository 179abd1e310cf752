"""Federation figures on loopback: table propagation and evacuation (`python -m bench federation`).

The real control plane — PostgreSQL, Redis, ``fedinfer serve`` (uvicorn) and ``fedinfer worker``
(the Celery worker that recompiles after every change, as in production) — and ``--edges``
regions, each with a simulated engine (one ``fedinfer engine-sim --count N``) and a
``fedinfer edge`` in control-plane mode (signed tables by long-poll, heartbeats).

(a) **Propagation**: an inventory change through the REST API (drain, then undrain, one
    region's instance: every region's table changes, since that region stops or starts serving
    the model) until every edge's ``/healthz`` shows a version newer than before the call.
    ``--changes`` changes, one at a time; p50/p99/max of the time until the *last* edge applied.
(b) **Evacuation**: a steady stream of requests (``--rate`` per second, a new session each) at
    one region's edge; ``POST /regions/{code}/evacuate/``; the time from the call to the last
    request served in that region (sent, and finished), per repetition; then the restore and
    the share served there again per second (the ramp, ``FEDINFER_RAMP_*``).

The bench uses its own database ``<name of --database-url>_fedbench`` (dropped and created)
and **flushes** the Redis DB of ``--redis-url``. JSON under ``var/bench/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx

from bench.harness.control_plane import MODEL, MODEL_SPEC, django_on_bench_database
from bench.harness.procs import VAR, bench_processes, fedinfer_argv, git_rev, http_ok, machine_info
from bench.harness.report import fmt, markdown_table, percentile, utc_now, write_result
from regions.supervisor import free_port, free_ports, wait_http

RAMP_SECONDS = 6
RAMP_STEPS = 3


@dataclass
class Fleet:
    codes: list[str]
    instance_ids: dict[str, int]
    credentials: dict[str, str]
    api_key: str
    admin_token: str


def build_fleet(codes: list[str], engine_ports: list[int], edge_ports: list[int]) -> Fleet:
    """Regions, links, one pool/deployment/ready instance each, edges, a tenant, an admin."""
    from django.contrib.auth.models import User

    from federation.inventory import services as inv
    from federation.inventory.models import AcceleratorType
    from federation.routing import services as routing
    from federation.tenancy import services as tenancy
    from federation.tenancy.models import Membership

    h100 = AcceleratorType.objects.get(name="H100-80G")
    model = inv.model_create(actor=None, **MODEL_SPEC)
    regions = {}
    for i, code in enumerate(codes):
        regions[code] = inv.region_create(
            actor=None,
            code=code,
            name=code,
            provider="cloud",
            latitude=10.0 + i,
            longitude=20.0 + i,
            jurisdiction="US",
        )
    for a in codes:
        for b in codes:
            if a != b:
                inv.region_link_set(actor=None, source=regions[a], target=regions[b], rtt_ms=20)
    instance_ids, credentials = {}, {}
    for code, engine_port, edge_port in zip(codes, engine_ports, edge_ports, strict=True):
        pool = inv.pool_create(
            actor=None,
            region=regions[code],
            name="h100",
            accelerator=h100,
            gpus_per_node=8,
            node_count=1,
            interconnect="nvlink",
            price_per_gpu_hour=Decimal("2.50"),
            capacity_type="on_demand",
        )
        dep = inv.deployment_create(actor=None, model=model, pool=pool, tensor_parallel_size=1)
        inst = inv.instance_create(
            actor=None,
            deployment=dep,
            name=f"{code}-0",
            endpoint_url=f"http://127.0.0.1:{engine_port}",
        )
        inst = inv.instance_bring_up(actor=None, instance=inst)
        instance_ids[code] = inst.pk
        edge = inv.edge_register(
            actor=None,
            region=regions[code],
            name=f"edge-{code}",
            url=f"http://127.0.0.1:{edge_port}",
        )
        credentials[code] = routing.edge_credential_rotate(actor=None, edge=edge)
    tenant = tenancy.tenant_create(actor=None, slug="bench", name="Bench")
    key = tenancy.api_key_create(actor=None, tenant=tenant, name="k").plaintext
    admin = User.objects.create_user(username="bench-admin", password=uuid.uuid4().hex)
    Membership.objects.create(user=admin, role=Membership.Role.ADMIN)
    admin_token = tenancy.auth_token_issue(user=admin).plaintext
    routing.routing_tables_publish()
    return Fleet(codes, instance_ids, credentials, key, admin_token)


async def versions(client: httpx.AsyncClient, edges: dict[str, str]) -> dict[str, int]:
    """The table version every edge applies now (its ``/healthz``)."""
    answers = await asyncio.gather(*(client.get(url + "/healthz") for url in edges.values()))
    return {code: int(r.json()["table_version"]) for code, r in zip(edges, answers, strict=True)}


async def propagation(
    api: str, fleet: Fleet, edges: dict[str, str], changes: int, poll_s: float
) -> list[dict[str, Any]]:
    """One change at a time: seconds from the API call until each edge applied a newer table."""
    out = []
    headers = {"Authorization": f"Token {fleet.admin_token}"}
    async with httpx.AsyncClient(timeout=10) as client:
        drained: set[str] = set()
        for i in range(changes):
            code = fleet.codes[(i // 2) % len(fleet.codes)]
            action = "undrain" if code in drained else "drain"
            before = await versions(client, edges)
            wall = time.time()
            started = time.perf_counter()
            r = await client.post(
                f"{api}/api/v1/instances/{fleet.instance_ids[code]}/{action}/", headers=headers
            )
            api_s = time.perf_counter() - started
            r.raise_for_status()
            drained ^= {code}
            applied: dict[str, float] = {}
            while len(applied) < len(edges):
                if time.perf_counter() - started > 30:
                    raise RuntimeError(f"change {i}: edges {set(edges) - set(applied)} lag")
                now = await versions(client, edges)
                t = time.perf_counter() - started
                for c, v in now.items():
                    if c not in applied and v > before[c]:
                        applied[c] = t
                await asyncio.sleep(poll_s)
            out.append(
                {
                    "change": f"{action} {code}",
                    "api_s": api_s,
                    "edges_s": applied,
                    "wall": wall,
                    "before": before,
                }
            )
            await asyncio.sleep(0.3)  # let the heartbeats settle; one change at a time
        for code in drained:  # leave every region serving for (b)
            r = await client.post(
                f"{api}/api/v1/instances/{fleet.instance_ids[code]}/undrain/", headers=headers
            )
            r.raise_for_status()
        await asyncio.sleep(1.0)
    return out


@dataclass
class Sent:
    at: float
    done: float
    status: int
    region: str


async def stream(edge: str, key: str, rate: float, stop: asyncio.Event, log: list[Sent]) -> None:
    """A steady open-loop stream: one request every 1/rate s, each its own session."""
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> None:
            at = time.perf_counter()
            try:
                r = await client.post(
                    edge + "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": f"hello {i}"}],
                        "max_tokens": 8,
                    },
                    headers={"Authorization": f"Bearer {key}", "x-session-id": f"s{i}"},
                )
                route = dict(
                    p.split("=", 1)
                    for p in r.headers.get("x-fedinfer-route", "").split(";")
                    if "=" in p
                )
                log.append(Sent(at, time.perf_counter(), r.status_code, route.get("region", "")))
            except httpx.HTTPError:
                log.append(Sent(at, time.perf_counter(), 0, ""))

        tasks = []
        i = 0
        start = time.perf_counter()
        while not stop.is_set():
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        await asyncio.gather(*tasks)


async def evacuation(
    api: str, fleet: Fleet, edges: dict[str, str], reps: int, rate: float
) -> list[dict[str, Any]]:
    """Evacuate and restore each region under a steady stream: when its last request left."""
    headers = {"Authorization": f"Token {fleet.admin_token}"}
    out = []
    async with httpx.AsyncClient(timeout=10) as client:
        for rep in range(reps):
            code = fleet.codes[rep % len(fleet.codes)]
            log: list[Sent] = []
            stop = asyncio.Event()
            task = asyncio.create_task(stream(edges[code], fleet.api_key, rate, stop, log))
            await asyncio.sleep(2.0)
            called = time.perf_counter()
            r = await client.post(f"{api}/api/v1/regions/{code}/evacuate/", headers=headers)
            r.raise_for_status()
            await asyncio.sleep(4.0)
            restored = time.perf_counter()
            r = await client.post(f"{api}/api/v1/regions/{code}/restore/", headers=headers)
            r.raise_for_status()
            await asyncio.sleep(RAMP_SECONDS + 3.0)
            stop.set()
            await task
            here = [s for s in log if s.region == code and s.status == 200]
            moved = [s for s in log if called <= s.at < restored]
            last = max((s for s in here if s.at < restored), key=lambda s: s.at)
            bins: dict[int, list[bool]] = {}
            for s in log:
                if s.at >= restored and s.status == 200:
                    bins.setdefault(int(s.at - restored), []).append(s.region == code)
            out.append(
                {
                    "region": code,
                    "last_sent_s": last.at - called,
                    "last_done_s": last.done - called,
                    "errors": sum(s.status != 200 for s in log),
                    "requests": len(log),
                    "during_evacuation": len(moved),
                    "share_after_restore": {k: sum(v) / len(v) for k, v in sorted(bins.items())},
                }
            )
            await asyncio.sleep(1.0)
    return out


def add_published(changes: list[dict[str, Any]]) -> None:
    """``published_s``: from the call until the worker stored the change's versions (their
    ``created_at``; the rest of the way is the long-poll and the edge applying it)."""
    from federation.routing.models import RoutingTableVersion

    for change in changes:
        stored = [
            RoutingTableVersion.objects.filter(region__code=code, version__gt=version)
            .order_by("version")
            .values_list("created_at", flat=True)
            .first()
            for code, version in change["before"].items()
        ]
        change["published_s"] = max(t.timestamp() for t in stored if t) - change["wall"]


def run(
    n_edges: int, changes: int, reps: int, rate: float, db_url: str, redis_url: str
) -> dict[str, Any]:
    """The control plane and its edges, then the propagation changes and the evacuations."""
    url = django_on_bench_database(db_url, redis_url)
    from django.conf import settings

    codes = [f"r{i}" for i in range(n_edges)]
    engine_ports = free_ports(n_edges)
    edge_ports = [free_port() for _ in codes]
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": redis_url,
        "DJANGO_SETTINGS_MODULE": "federation.settings",
        # No periodic recompile during (a): only the changes publish versions.
        "FEDINFER_TABLES_REFRESH_SECONDS": "3600",
        "FEDINFER_RAMP_SECONDS": str(RAMP_SECONDS),
        "FEDINFER_RAMP_STEPS": str(RAMP_STEPS),
    }
    with bench_processes(VAR / "federation-logs") as group:
        engines = group.start(
            "engines",
            fedinfer_argv(
                "engine-sim", "--count", str(n_edges), "--port", str(engine_ports[0]),
                "--model", MODEL, "--log-level", "warning",
            ),
        )  # fmt: skip
        fleet = build_fleet(codes, engine_ports, edge_ports)
        api_port = free_port()
        api = f"http://127.0.0.1:{api_port}"
        serve = group.start(
            "serve", fedinfer_argv("serve", "--no-migrate", "--port", str(api_port)), env=env
        )
        group.start(
            "worker",
            fedinfer_argv("worker", "--pool", "solo", "--without-gossip", "--without-mingle"),
            env=env,
        )
        wait_http(f"http://127.0.0.1:{engine_ports[-1]}/health", watch=engines, ready=http_ok)
        # Any answer below 500 (401 without credentials) means the control plane is up.
        wait_http(api + "/api/v1/", watch=serve, timeout=60.0)
        ring = VAR / "federation-logs" / "table-keys"
        ring.write_text(
            f"{settings.FEDINFER_TABLE_SIGNING_KEY_ID}={settings.FEDINFER_TABLE_SIGNING_KEY}"
        )
        ring.chmod(0o600)
        edges, ops = {}, {}
        for code, port in zip(codes, edge_ports, strict=True):
            ops_port = free_ports(1)[0]
            cred = VAR / "federation-logs" / f"cred-{code}"
            cred.write_text(fleet.credentials[code])
            proc = group.start(
                f"edge-{code}",
                fedinfer_argv(
                    "edge", "--region", code, "--control-plane", api, "--credential-file",
                    str(cred), "--table-keys-file", str(ring), "--edge-name", f"edge-{code}",
                    "--state-dir", str(VAR / "federation-logs" / f"state-{code}"),
                    "--port", str(port), "--operator-port", str(ops_port),
                    "--heartbeat-interval", "1", "--log-level", "warning",
                ),
                env=env,
            )  # fmt: skip
            edges[code] = f"http://127.0.0.1:{port}"
            ops[code] = f"http://127.0.0.1:{ops_port}"
            wait_http(ops[code] + "/healthz", watch=proc, ready=http_ok)
        load_before = os.getloadavg()
        # Versions are read from each edge's operator listener (/healthz).
        prop = asyncio.run(propagation(api, fleet, ops, changes, poll_s=0.01))
        add_published(prop)
        evac = asyncio.run(evacuation(api, fleet, edges, reps, rate))
    return {
        "date": utc_now(),
        "git": git_rev(),
        "machine": machine_info(),
        "loadavg_before": load_before,
        "edges": n_edges,
        "propagation": prop,
        "evacuation": evac,
    }


def report(result: dict[str, Any]) -> str:
    """The result as the Markdown tables of docs/benchmarks.md."""
    last = [max(c["edges_s"].values()) for c in result["propagation"]]
    every = [t for c in result["propagation"] for t in c["edges_s"].values()]
    api = [c["api_s"] for c in result["propagation"]]
    published = [c["published_s"] for c in result["propagation"]]
    rows = [
        [
            label,
            len(vals),
            fmt(percentile(vals, 50) * 1000, 0),
            fmt(percentile(vals, 99) * 1000, 0),
            fmt(max(vals) * 1000, 0),
        ]
        for label, vals in (
            ("API call (commit + queue the recompile)", api),
            ("change -> versions stored by the worker", published),
            ("change -> one edge applied (each edge)", every),
            ("**change -> every edge applied**", last),
        )
    ]
    out = [markdown_table(["figure", "n", "p50 ms", "p99 ms", "max ms"], rows), ""]
    evac_rows = []
    for e in result["evacuation"]:
        shares = " ".join(f"{v:.2f}" for v in e["share_after_restore"].values())
        evac_rows.append(
            [
                e["region"],
                e["requests"],
                fmt(e["last_sent_s"] * 1000, 0),
                fmt(e["last_done_s"] * 1000, 0),
                e["errors"],
                shares,
            ]
        )
    out.append(
        markdown_table(
            [
                "region",
                "requests",
                "call -> last sent there, ms",
                "call -> last done there, ms",
                "errors",
                "share served there per second after restore",
            ],
            evac_rows,
        )
    )
    return "\n".join(out)


def main(argv: list[str]) -> None:
    """Run both measurements; print the tables and write the JSON under var/bench/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", type=int, default=5, help="regions, one edge each (3-10)")
    parser.add_argument("--changes", type=int, default=40, help="inventory changes for (a)")
    parser.add_argument("--reps", type=int, default=5, help="evacuations for (b)")
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s of (b)'s stream")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL", ""))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    opts = parser.parse_args(argv)
    if not opts.database_url.startswith("postgres") or not opts.redis_url:
        raise SystemExit("needs --database-url postgres://... and --redis-url (or the env vars)")
    result = run(opts.edges, opts.changes, opts.reps, opts.rate, opts.database_url, opts.redis_url)
    path = write_result("federation", result)
    print(report(result))
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
