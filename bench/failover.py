"""Engine death on loopback: how fast a dead engine leaves every table (`python -m bench failover`).

The real control plane — PostgreSQL, Redis, ``fedinfer serve`` and ``fedinfer worker`` (which
here also provisions: every region's pool is ``local``, so the worker starts each region's
``fedinfer engine-sim``) — and per region a ``fedinfer edge`` in control-plane mode. A steady
stream of requests (``--rate`` per second, new sessions) goes to the first region's edge. Each
repetition SIGKILLs that region's engine (its whole process group, behind the worker's back)
and measures from the kill:

* **failed**: the instance is marked failed (the worker saw the process gone);
* **out of all tables**: every region's newest stored table no longer lists it (target ≤ 5 s);
* **every edge applied**: every edge's ``/healthz`` shows that version or newer;
* **replacement ready**: a new instance of the deployment is ready;
* the stream's requests that failed between the kill and the replacement (the edge retries a
  request elsewhere only before its first byte: with one engine per region, requests go to
  another region once the edge's own health check or the new table says so).

The bench uses its own database ``<name of --database-url>_fedbench`` (dropped and created)
and **flushes** the Redis DB of ``--redis-url``. JSON under ``var/bench/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from bench.federation import MODEL_SPEC, Sent, django_on_bench_database, stream
from bench.procs import VAR, bench_processes, fedinfer_argv, git_rev, http_ok, machine_info
from bench.report import fmt, markdown_table, percentile, utc_now, write_result
from regions.supervisor import free_port, free_ports, wait_http, wait_until

LOGS = VAR / "failover-logs"


def build(codes: list[str], edge_ports: list[int]) -> tuple[dict[str, str], str]:
    """Regions with a ``local`` pool and a deployment of one replica each, edges, a tenant.
    Returns the edges' credentials and the tenant's API key."""
    from decimal import Decimal

    from federation.inventory import services as inv
    from federation.inventory.models import AcceleratorType
    from federation.routing import services as routing
    from federation.tenancy import services as tenancy

    h100 = AcceleratorType.objects.get(name="H100-80G")
    model = inv.model_create(actor=None, **MODEL_SPEC)
    regions = {
        code: inv.region_create(
            actor=None,
            code=code,
            name=code,
            provider="cloud",
            latitude=10.0 + i,
            longitude=20.0 + i,
            jurisdiction="US",
        )
        for i, code in enumerate(codes)
    }
    for a in codes:
        for b in codes:
            if a != b:
                inv.region_link_set(actor=None, source=regions[a], target=regions[b], rtt_ms=20)
    credentials = {}
    for code, port in zip(codes, edge_ports, strict=True):
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
            provisioner="local",
        )
        inv.deployment_create(
            actor=None, model=model, pool=pool, tensor_parallel_size=1, max_replicas=2
        )
        edge = inv.edge_register(
            actor=None, region=regions[code], name=f"edge-{code}", url=f"http://127.0.0.1:{port}"
        )
        credentials[code] = routing.edge_credential_rotate(actor=None, edge=edge)
    tenant = tenancy.tenant_create(actor=None, slug="bench", name="Bench")
    key = tenancy.api_key_create(actor=None, tenant=tenant, name="k").plaintext
    routing.routing_tables_publish()
    return credentials, key


def ready_instance(code: str) -> str | None:
    from federation.inventory.models import Instance

    return (
        Instance.objects.filter(deployment__pool__region__code=code, state="ready")
        .values_list("name", flat=True)
        .first()
    )


def tables_without(name: str) -> dict[str, int] | None:
    """Every region's newest version if none lists ``name``; None while one does."""
    from federation.routing.models import RoutingTableVersion

    newest: dict[str, int] = {}
    for table in RoutingTableVersion.objects.order_by("region_id", "-version").distinct(
        "region_id"
    ):
        if name in {i["id"] for i in table.document.get("instances", [])}:
            return None
        newest[table.document["region"]] = table.version
    return newest


def edges_applied(ops: dict[str, str], versions: dict[str, int]) -> bool:
    for code, url in ops.items():
        try:
            applied = int(httpx.get(url + "/healthz", timeout=2).json()["table_version"])
        except (httpx.HTTPError, KeyError, ValueError):
            return False
        if applied < versions.get(code, 0):
            return False
    return True


def one_kill(code: str, ops: dict[str, str], engines_dir: str) -> dict[str, Any]:
    """Kill the engine of ``code``'s ready instance; the times until each stage, seconds."""
    from federation.inventory.models import Instance
    from workers.provisioners.local import LocalProvisioner

    victim = ready_instance(code)
    if victim is None:
        raise RuntimeError(f"{code} has no ready instance to kill")
    pid = int(LocalProvisioner(Path(engines_dir)).running()[victim].detail["pid"])
    killed = time.perf_counter()
    os.killpg(pid, signal.SIGKILL)
    marks: dict[str, float] = {}
    versions: dict[str, int] | None = None
    while len(marks) < 4:
        now = time.perf_counter() - killed
        if now > 120:
            raise RuntimeError(f"kill of {victim}: only {sorted(marks)} within 120 s")
        if "failed" not in marks and Instance.objects.get(name=victim).state == "failed":
            marks["failed"] = now
        if versions is None:
            versions = tables_without(victim)
            if versions is not None:
                marks["tables"] = now
        elif "edges" not in marks and edges_applied(ops, versions):
            marks["edges"] = now
        if "replaced" not in marks and ready_instance(code) not in (None, victim):
            marks["replaced"] = now
        time.sleep(0.01)
    return {"instance": victim, "at": killed, **marks}


async def _stream_while(edge: str, key: str, rate: float, work: Any) -> list[Sent]:
    stop = asyncio.Event()
    sent: list[Sent] = []
    task = asyncio.create_task(stream(edge, key, rate, stop, sent))
    try:
        await asyncio.to_thread(work)
    finally:
        stop.set()
        await task
    return sent


def run(n_regions: int, reps: int, rate: float, db_url: str, redis_url: str) -> dict[str, Any]:
    engines_dir = str(LOGS / "engines")
    django_on_bench_database(db_url, redis_url, FEDINFER_LOCAL_ENGINES_DIR=engines_dir)
    from django.conf import settings

    from workers.provisioners.local import LocalProvisioner

    codes = [f"r{i}" for i in range(n_regions)]
    edge_ports = [free_port() for _ in codes]
    credentials, key = build(codes, edge_ports)
    env = {
        **os.environ,
        "FEDINFER_TABLES_REFRESH_SECONDS": "3600",  # only the failover publishes
        "FEDINFER_FLEET_INTERVAL_SECONDS": "1",
    }
    kills: list[dict[str, Any]] = []
    streams: list[dict[str, Any]] = []
    with bench_processes(LOGS) as group:
        try:
            api_port = free_port()
            api = f"http://127.0.0.1:{api_port}"
            serve = group.start(
                "serve", fedinfer_argv("serve", "--no-migrate", "--port", str(api_port)), env=env
            )
            worker = group.start(
                "worker",
                fedinfer_argv("worker", "--pool", "solo", "--without-gossip", "--without-mingle"),
                env=env,
            )
            wait_http(api + "/api/v1/", watch=serve, timeout=60.0)
            wait_until(
                lambda: all(ready_instance(c) for c in codes),
                what="every region's engine ready",
                timeout=120,
                watch=worker,
            )
            ring = LOGS / "table-keys"
            ring.write_text(
                f"{settings.FEDINFER_TABLE_SIGNING_KEY_ID}={settings.FEDINFER_TABLE_SIGNING_KEY}"
            )
            ring.chmod(0o600)
            edges, ops = {}, {}
            for code, port in zip(codes, edge_ports, strict=True):
                ops_port = free_ports(1)[0]
                cred = LOGS / f"cred-{code}"
                cred.write_text(credentials[code])
                proc = group.start(
                    f"edge-{code}",
                    fedinfer_argv(
                        "edge", "--region", code, "--control-plane", api, "--credential-file",
                        str(cred), "--table-keys-file", str(ring), "--edge-name", f"edge-{code}",
                        "--state-dir", str(LOGS / f"state-{code}"), "--port", str(port),
                        "--operator-port", str(ops_port), "--heartbeat-interval", "1",
                        "--log-level", "warning",
                    ),
                    env=env,
                )  # fmt: skip
                edges[code] = f"http://127.0.0.1:{port}"
                ops[code] = f"http://127.0.0.1:{ops_port}"
                wait_http(ops[code] + "/healthz", watch=proc, ready=http_ok)
            load_before = os.getloadavg()
            for _ in range(reps):
                result: dict[str, Any] = {}

                def kill(result: dict[str, Any] = result) -> None:
                    result.update(one_kill(codes[0], ops, engines_dir))

                sent = asyncio.run(_stream_while(edges[codes[0]], key, rate, kill))
                kills.append(result)
                end = result["at"] + result["replaced"]
                during = [s for s in sent if result["at"] <= s.at <= end]
                streams.append(
                    {
                        "requests": len(during),
                        "failed": sum(1 for s in during if s.status != 200),
                    }
                )
                time.sleep(2)
        finally:
            # The engines outlive the worker by design: stop the worker (which could start
            # more), then them.
            group.stop_all()
            provisioner = LocalProvisioner(LOGS / "engines")
            for name in provisioner.running():
                provisioner.stop(name)
    return {
        "date": utc_now(),
        "git": git_rev(),
        "machine": machine_info(),
        "loadavg_before": load_before,
        "regions": n_regions,
        "rate": rate,
        "kills": kills,
        "streams": streams,
    }


def report(result: dict[str, Any]) -> str:
    rows = []
    for label, key in (
        ("kill -> marked failed", "failed"),
        ("**kill -> out of every stored table**", "tables"),
        ("kill -> every edge applied it", "edges"),
        ("kill -> replacement ready", "replaced"),
    ):
        vals = [k[key] for k in result["kills"]]
        rows.append(
            [
                label,
                len(vals),
                fmt(percentile(vals, 50) * 1000, 0),
                fmt(percentile(vals, 99) * 1000, 0),
                fmt(max(vals) * 1000, 0),
            ]
        )
    requests = sum(s["requests"] for s in result["streams"])
    failed = sum(s["failed"] for s in result["streams"])
    table = markdown_table(["figure", "n", "p50 ms", "p99 ms", "max ms"], rows)
    return f"{table}\n\nrequests from kill to replacement: {requests}, failed: {failed}"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", type=int, default=3, help="regions, one engine and edge each")
    parser.add_argument("--reps", type=int, default=10, help="engine kills")
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s at the first edge")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL", ""))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    opts = parser.parse_args(argv)
    if not opts.database_url.startswith("postgres") or not opts.redis_url:
        raise SystemExit("needs --database-url postgres://... and --redis-url (or the env vars)")
    result = run(opts.regions, opts.reps, opts.rate, opts.database_url, opts.redis_url)
    path = write_result("failover", result)
    print(report(result))
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
