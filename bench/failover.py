"""Engine death, region loss and a load step on loopback (`python -m bench failover`).

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
* **region loss**: with one engine per region, the kill takes every engine of the first region
  (its edge stays up and must send its traffic to the other regions). The stream is of
  streamed completions: each request is classed by whether its first token had arrived when it
  failed. Figures: the last failed request's start after the kill (target ≤ 10 s) and the
  failures of requests not yet streaming (target 0: the edge retries those elsewhere).

The kills come seconds apart, each of the region's only engine: to the fleet's region failover
that is "2 of 2 instances failed within 60 s", and it evacuates the region — correctly, for a
region whose engines keep dying — whereupon the replacement waits, warm, for the region's
restore (the failures out of the 60 s window, then 30 s stable: ~87 s after the kill, seen as
one slow replacement in five). That is the failover test's subject
(``tests/integration/test_fleet_failover.py``), not an engine's death: the bench raises
``FEDINFER_FAILOVER_MIN_FAILED`` above its number of kills, and reports the region evacuations
it saw (expected: none).

Then the **load step**: the first region's deployment is switched to ``autoscale`` and every
slot of its engine (``max-num-seqs`` ``--slots``) is taken by long streams at once; measured
from the step: the autoscaler's decision (``fleet.autoscale`` event), a new instance started
(loading or warming; target ≤ 15 s), and ready. The streams are then closed and the deployment
scales back down (short window and cooldown here) before the next repetition.

The bench uses its own database ``<name of --database-url>_fedbench`` (dropped and created)
and **flushes** the Redis DB of ``--redis-url``. JSON under ``var/bench/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.harness.control_plane import MODEL, MODEL_SPEC, django_on_bench_database
from bench.harness.procs import VAR, bench_processes, fedinfer_argv, git_rev, http_ok, machine_info
from bench.harness.report import fmt, markdown_table, percentile, utc_now, write_result
from regions.supervisor import free_port, free_ports, wait_http, wait_until

LOGS = VAR / "failover-logs"


def build(codes: list[str], edge_ports: list[int], slots: int) -> tuple[dict[str, str], str, str]:
    """Regions with a ``local`` pool and a deployment of one replica each, edges, two tenants:
    one served anywhere, one held to the first region. Returns the edges' credentials and the
    tenants' API keys (anywhere, first region only)."""
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
            actor=None,
            model=model,
            pool=pool,
            tensor_parallel_size=1,
            max_replicas=2,
            engine_args={"max-num-seqs": slots},
        )
        edge = inv.edge_register(
            actor=None, region=regions[code], name=f"edge-{code}", url=f"http://127.0.0.1:{port}"
        )
        credentials[code] = routing.edge_credential_rotate(actor=None, edge=edge)
    tenant = tenancy.tenant_create(actor=None, slug="bench", name="Bench")
    key = tenancy.api_key_create(actor=None, tenant=tenant, name="k").plaintext
    local = tenancy.tenant_create(
        actor=None,
        slug="bench-local",
        name="Bench, first region",
        allowed_regions=[regions[codes[0]]],
    )
    local_key = tenancy.api_key_create(actor=None, tenant=local, name="k").plaintext
    routing.routing_tables_publish()
    return credentials, key, local_key


def ready_instance(code: str) -> str | None:
    """The region's ready instance, if any: the one a kill takes."""
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
    """Whether every edge applies at least the given table versions (its ``/healthz``)."""
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


@dataclass
class Streamed:
    """One streamed completion: when it was sent, when its first token came (None: never), and
    whether it ended with ``[DONE]``."""

    at: float
    first: float | None = None
    ok: bool = False


def _chat(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}: hello"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


async def streamed(
    edge: str, key: str, rate: float, stop: asyncio.Event, log: list[Streamed]
) -> None:
    """An open-loop stream of short streamed completions, one every 1/rate s."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> None:
            sent = Streamed(time.perf_counter())
            log.append(sent)
            try:
                body = _chat(i, 16)
                url = edge + "/v1/chat/completions"
                async with client.stream("POST", url, json=body, headers=headers) as r:
                    if r.status_code != 200:
                        return
                    async for line in r.aiter_lines():
                        if sent.first is None and line.startswith("data: {"):
                            sent.first = time.perf_counter()
                        if line == "data: [DONE]":
                            sent.ok = True
            except httpx.HTTPError:
                return

        tasks, i, start = [], 0, time.perf_counter()
        while not stop.is_set():
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        await asyncio.gather(*tasks)


def region_loss(sent: list[Streamed], killed: float, until: float) -> dict[str, Any]:
    """What the kill cost the stream: requests sent from 10 s before it (those in flight) to
    ``until``; failures by whether they were streaming; the last failed one's start."""
    during = [s for s in sent if killed - 10 <= s.at <= until]
    failed = [s for s in during if not s.ok]
    return {
        "requests": len(during),
        "failed": len(failed),
        "failed_not_streaming": sum(1 for s in failed if s.first is None),
        "failed_streaming": sum(1 for s in failed if s.first is not None),
        "last_failed_s": max((s.at - killed for s in failed), default=None),
    }


def load_step(code: str, edge: str, key: str, slots: int) -> dict[str, Any]:
    """Take every slot of ``code``'s one engine with long streams of a tenant held to that
    region (an open tenant's new sessions are shared with the other regions by the plan's split,
    and they carry the step without a new replica); the times from the step to the
    autoscaler's decision, a new instance started, and it ready. Then let it scale down."""
    from federation.core.models import AuditEvent
    from federation.inventory import services as inv
    from federation.inventory.models import Deployment, Instance

    dep = Deployment.objects.get(pool__region__code=code)
    inv.deployment_update(actor=None, deployment=dep, data={"autoscale": True})
    known = set(Instance.objects.filter(deployment=dep).values_list("name", flat=True))
    seen = AuditEvent.objects.filter(action="fleet.autoscale").count()
    marks: dict[str, float] = {}

    async def step() -> None:
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=120) as client:
            stop = asyncio.Event()

            async def hold(i: int) -> None:
                body = _chat(10_000 + i, 20_000)
                url = edge + "/v1/chat/completions"
                async with client.stream("POST", url, json=body, headers=headers) as r:
                    async for _ in r.aiter_lines():
                        if stop.is_set():
                            return

            started = time.perf_counter()
            holds = [asyncio.create_task(hold(i)) for i in range(slots)]
            while len(marks) < 3:
                now = time.perf_counter() - started
                if now > 180:
                    raise RuntimeError(f"load step: only {sorted(marks)} within 180 s")
                new = await asyncio.to_thread(_new_instances, dep.pk, known)
                if "decided" not in marks and await asyncio.to_thread(
                    lambda: AuditEvent.objects.filter(action="fleet.autoscale").count() > seen
                ):
                    marks["decided"] = now
                if "started" not in marks and any(s != "pending" for s in new.values()):
                    marks["started"] = now
                if "ready" not in marks and "ready" in new.values():
                    marks["ready"] = now
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.gather(*holds, return_exceptions=True)

    asyncio.run(step())
    # Back to one replica (the bench's short window and cooldown) before the next step.
    wait_until(
        lambda: Instance.objects.filter(deployment=dep, state__in=LIVE).count() == 1,
        what="scaled back to one replica",
        timeout=180,
    )
    inv.deployment_update(actor=None, deployment=dep, data={"autoscale": False})
    return marks


LIVE = ("pending", "loading", "warming", "ready", "draining")


def _new_instances(deployment_id: int, known: set[str]) -> dict[str, str]:
    from federation.inventory.models import Instance

    rows = Instance.objects.filter(deployment_id=deployment_id).values_list("name", "state")
    return {n: s for n, s in rows if n not in known}


async def _stream_while(edge: str, key: str, rate: float, work: Any) -> list[Streamed]:
    stop = asyncio.Event()
    sent: list[Streamed] = []
    task = asyncio.create_task(streamed(edge, key, rate, stop, sent))
    try:
        await asyncio.to_thread(work)
    finally:
        stop.set()
        await task
    return sent


def run(
    n_regions: int, reps: int, steps: int, slots: int, rate: float, db_url: str, redis_url: str
) -> dict[str, Any]:
    """The control plane with local engines, then the kills and the load steps."""
    engines_dir = str(LOGS / "engines")
    django_on_bench_database(db_url, redis_url, FEDINFER_LOCAL_ENGINES_DIR=engines_dir)
    from django.conf import settings

    from workers.provisioners.local import LocalProvisioner

    codes = [f"r{i}" for i in range(n_regions)]
    edge_ports = [free_port() for _ in codes]
    credentials, key, local_key = build(codes, edge_ports, slots)
    env = {
        **os.environ,
        "FEDINFER_TABLES_REFRESH_SECONDS": "3600",  # only the failover publishes
        "FEDINFER_FLEET_INTERVAL_SECONDS": "1",
        # The load step's scale-down between repetitions, not measured: short.
        "FEDINFER_AUTOSCALE_DOWN_WINDOW_SECONDS": "3",
        "FEDINFER_AUTOSCALE_COOLDOWN_SECONDS": "5",
        "FEDINFER_FLEET_DRAIN_TIMEOUT_SECONDS": "10",
        # Back-to-back kills of one region's only engine must not read as a region in trouble
        # (see the module's docstring): no evacuation on failed instances during the kills.
        "FEDINFER_FAILOVER_MIN_FAILED": str(reps + 1),
    }
    steps_done: list[dict[str, float]] = []
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
                streams.append(region_loss(sent, result["at"], result["at"] + result["replaced"]))
                time.sleep(2)
            for _ in range(steps):
                steps_done.append(load_step(codes[0], edges[codes[0]], local_key, slots))
        finally:
            # The engines outlive the worker by design: stop the worker (which could start
            # more), then them.
            group.stop_all()
            provisioner = LocalProvisioner(LOGS / "engines")
            for name in provisioner.running():
                provisioner.stop(name)
    from federation.core.models import AuditEvent

    return {
        "date": utc_now(),
        "git": git_rev(),
        "region_evacuations": AuditEvent.objects.filter(action="fleet.region_evacuate").count(),
        "machine": machine_info(),
        "loadavg_before": load_before,
        "regions": n_regions,
        "rate": rate,
        "kills": kills,
        "streams": streams,
        "slots": slots,
        "load_steps": steps_done,
    }


def report(result: dict[str, Any]) -> str:
    """The result as the Markdown tables of docs/benchmarks.md."""
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
    table = markdown_table(["figure", "n", "p50 ms", "p99 ms", "max ms"], rows)
    table += f"\n\nregion evacuations by the fleet during the run: {result['region_evacuations']}"
    streams = result["streams"]
    last = [s["last_failed_s"] for s in streams if s["last_failed_s"] is not None]
    loss = (
        f"region loss (every engine of the region killed; {len(streams)} times): "
        f"{sum(s['requests'] for s in streams)} requests from 10 s before each kill to its "
        f"replacement, {sum(s['failed'] for s in streams)} failed — "
        f"{sum(s['failed_not_streaming'] for s in streams)} not yet streaming, "
        f"{sum(s['failed_streaming'] for s in streams)} mid-stream; last failed request sent "
        + (f"{max(last):.2f} s after the kill" if last else "— (none failed)")
    )
    steps = result.get("load_steps") or []
    step_rows = []
    for label, key in (
        ("load step -> autoscaler decides", "decided"),
        ("**load step -> new instance started (loading/warming)**", "started"),
        ("load step -> new instance ready", "ready"),
    ):
        vals = [s[key] for s in steps]
        if vals:
            step_rows.append(
                [label, len(vals), fmt(percentile(vals, 50) * 1000, 0), fmt(max(vals) * 1000, 0)]
            )
    step_table = markdown_table(["figure", "n", "p50 ms", "max ms"], step_rows) if step_rows else ""
    return f"{table}\n\n{loss}\n\n{step_table}"


def main(argv: list[str]) -> None:
    """Run the kills and steps; print the tables and write the JSON under var/bench/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", type=int, default=3, help="regions, one engine and edge each")
    parser.add_argument("--reps", type=int, default=10, help="engine kills")
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s at the first edge")
    parser.add_argument("--steps", type=int, default=3, help="load steps")
    parser.add_argument("--slots", type=int, default=8, help="max-num-seqs of the engines")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL", ""))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    opts = parser.parse_args(argv)
    if not opts.database_url.startswith("postgres") or not opts.redis_url:
        raise SystemExit("needs --database-url postgres://... and --redis-url (or the env vars)")
    result = run(
        opts.regions,
        opts.reps,
        opts.steps,
        opts.slots,
        opts.rate,
        opts.database_url,
        opts.redis_url,
    )
    path = write_result("failover", result)
    print(report(result))
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
