"""Scale from zero: a cold model's first request to its first token (`python -m bench cold-start`).

The real control plane — PostgreSQL, Redis, ``fedinfer serve`` and ``fedinfer worker`` with the
local provisioner (``fedinfer engine-sim`` engines) — and one ``fedinfer edge`` in control-plane
mode. One deployment may scale to zero (``scale_to_zero_after_s``) and starts at zero. Each
repetition waits until it has no live instance, sends one streamed completion and measures from
the send:

* **wake decided**: the autoscaler's ``fleet.autoscale`` event 0 → 1 (the edge's heartbeat
  reports the held request and queues the pass at once);
* **instance ready**: the new instance is ready (the engine answers ``/health`` and
  ``/v1/models``);
* **first token** at the client (cold-start-to-first-token), and the same request's TTFT once
  warm, in the same run, as the baseline;

then leaves the deployment idle until it is back at zero. Then, per ``--adapters``, a LoRA
adapter registered for the model but loaded nowhere: with the replica warm (one request to the
base model first), one request naming the adapter, measured from its send to the
``fleet.adapter_load`` event (loaded onto the running replica with ``/v1/load_lora_adapter``)
and to its first token. The periodic autoscale pass runs only
every ``--autoscale-interval`` seconds, so a fast wake is the heartbeat's doing. The engine
simulator loads no weights: a real vLLM adds its weight loading and warm-up (minutes) to the
"instance ready" figure, the rest of the path is the same.

Its own database ``<name of --database-url>_fedbench`` (dropped and created); **flushes** the
Redis DB of ``--redis-url``. JSON under ``var/bench/``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness.control_plane import MODEL, MODEL_SPEC, django_on_bench_database
from bench.harness.procs import VAR, bench_processes, fedinfer_argv, git_rev, http_ok, machine_info
from bench.harness.report import fmt, markdown_table, percentile, utc_now, write_result
from regions.supervisor import free_port, wait_http, wait_until

LOGS = VAR / "cold-start-logs"
REGION = "r0"


def build(edge_port: int, idle_s: int, adapters: int) -> tuple[str, str, int]:
    """A region with a local pool and a deployment at zero, its edge, a tenant; the edge's
    credential, the tenant's key and the deployment's id."""
    from decimal import Decimal

    from federation.inventory import services as inv
    from federation.inventory.models import AcceleratorType
    from federation.routing import services as routing
    from federation.tenancy import services as tenancy

    model = inv.model_create(actor=None, **MODEL_SPEC)
    region = inv.region_create(
        actor=None, code=REGION, name=REGION, provider="cloud", latitude=10.0, longitude=20.0,
        jurisdiction="US",
    )  # fmt: skip
    pool = inv.pool_create(
        actor=None, region=region, name="h100",
        accelerator=AcceleratorType.objects.get(name="H100-80G"), gpus_per_node=8, node_count=1,
        interconnect="nvlink", price_per_gpu_hour=Decimal("2.50"), capacity_type="on_demand",
        provisioner="local",
    )  # fmt: skip
    dep = inv.deployment_create(
        actor=None, model=model, pool=pool, tensor_parallel_size=1, min_replicas=0,
        desired_replicas=0, max_replicas=1, autoscale=True, scale_to_zero_after_s=idle_s,
        engine_args={"max-num-seqs": 8},
    )  # fmt: skip
    for i in range(adapters):
        inv.adapter_create(
            actor=None, base_model=model, name=f"bench-lora-{i}", rank=16, source=f"/lora/{i}"
        )
    edge = inv.edge_register(
        actor=None, region=region, name=f"edge-{REGION}", url=f"http://127.0.0.1:{edge_port}"
    )
    credential = routing.edge_credential_rotate(actor=None, edge=edge)
    tenant = tenancy.tenant_create(actor=None, slug="bench", name="Bench")
    key = tenancy.api_key_create(actor=None, tenant=tenant, name="k").plaintext
    routing.routing_tables_publish()
    return credential, key, dep.pk


def live_instances(deployment_id: int) -> int:
    """The deployment's instances not yet gone: zero is where a cold start begins."""
    from federation.inventory import lifecycle
    from federation.inventory.models import Instance

    return Instance.objects.filter(
        deployment_id=deployment_id, state__in=lifecycle.LIVE_STATES
    ).count()


def first_token(edge: str, key: str, i: int, model: str = MODEL) -> tuple[int, float, float]:
    """One streamed completion: (status, seconds to its first token, to its end)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"cold start {i}"}],
        "max_tokens": 16,
        "stream": True,
    }
    started = time.perf_counter()
    first = 0.0
    with httpx.stream(
        "POST",
        edge + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    ) as r:
        for line in r.iter_lines():
            if not first and line.startswith("data: {"):
                first = time.perf_counter() - started
        return r.status_code, first, time.perf_counter() - started


def one_cold_start(edge: str, key: str, deployment_id: int, i: int) -> dict[str, Any]:
    """One request to a model at zero, timed to the autoscaler's event, readiness and first
    token."""
    from federation.core.models import AuditEvent
    from federation.inventory.models import InstanceInterval

    wait_until(lambda: live_instances(deployment_id) == 0, what="at zero", timeout=300)
    seen = AuditEvent.objects.filter(action="fleet.autoscale").order_by("-pk").first()
    after = seen.pk if seen is not None else 0
    sent = time.time()
    status, ttft, total = first_token(edge, key, i)
    if status != 200 or not ttft:
        raise RuntimeError(f"cold request {i}: status {status}")
    woke = (
        AuditEvent.objects.filter(action="fleet.autoscale", pk__gt=after)
        .order_by("pk")
        .values_list("created_at", "changes")
        .first()
    )
    if woke is None or woke[1]["desired_replicas"] != [0, 1]:
        raise RuntimeError(f"cold request {i}: no wake event ({woke})")
    ready_at = (
        InstanceInterval.objects.filter(
            instance__deployment_id=deployment_id, ready_at__isnull=False
        )
        .order_by("-ready_at")
        .values_list("ready_at", flat=True)
        .first()
    )
    assert ready_at is not None
    warm_status, warm_ttft, _ = first_token(edge, key, 10_000 + i)
    if warm_status != 200:
        raise RuntimeError(f"warm request {i}: status {warm_status}")
    return {
        "decided": woke[0].timestamp() - sent,
        "ready": ready_at.timestamp() - sent,
        "first_token": ttft,
        "total": total,
        "warm_first_token": warm_ttft,
    }


def one_adapter(edge: str, key: str, i: int) -> dict[str, Any]:
    """One request naming an adapter loaded nowhere, on a warm replica: loaded in place, not
    restarted."""
    from federation.core.models import AuditEvent

    status, _, _ = first_token(edge, key, 20_000 + i)  # the replica warm (woken if at zero)
    if status != 200:
        raise RuntimeError(f"warm-up {i}: status {status}")
    name = f"bench-lora-{i}"
    sent = time.time()
    status, ttft, total = first_token(edge, key, 30_000 + i, model=name)
    if status != 200 or not ttft:
        raise RuntimeError(f"adapter request {i}: status {status}")
    loaded = AuditEvent.objects.filter(
        action="fleet.adapter_load", changes__adapter=name, changes__reason__isnull=False
    ).values_list("created_at", flat=True)
    if not loaded:
        raise RuntimeError(f"adapter request {i}: no fleet.adapter_load event")
    return {"loaded": loaded[0].timestamp() - sent, "first_token": ttft, "total": total}


def run(
    reps: int, adapters: int, idle_s: int, autoscale_every: int, db_url: str, redis_url: str
) -> dict[str, Any]:
    """The control plane with the local provisioner, then every cold start and adapter load."""
    engines_dir = str(LOGS / "engines")
    django_on_bench_database(db_url, redis_url, FEDINFER_LOCAL_ENGINES_DIR=engines_dir)
    from django.conf import settings

    from workers.provisioners.local import LocalProvisioner

    edge_port, ops_port, api_port = free_port(), free_port(), free_port()
    credential, key, deployment_id = build(edge_port, idle_s, adapters)
    env = {
        **os.environ,
        "FEDINFER_FLEET_INTERVAL_SECONDS": "1",
        "FEDINFER_AUTOSCALE_INTERVAL_SECONDS": str(autoscale_every),
        "FEDINFER_AUTOSCALE_DOWN_WINDOW_SECONDS": "2",
        "FEDINFER_AUTOSCALE_COOLDOWN_SECONDS": "2",
        "FEDINFER_FLEET_DRAIN_TIMEOUT_SECONDS": "10",
    }
    results: list[dict[str, Any]] = []
    loads: list[dict[str, Any]] = []
    with bench_processes(LOGS) as group:
        try:
            api = f"http://127.0.0.1:{api_port}"
            serve = group.start(
                "serve", fedinfer_argv("serve", "--no-migrate", "--port", str(api_port)), env=env
            )
            group.start(
                "worker",
                fedinfer_argv("worker", "--pool", "solo", "--without-gossip", "--without-mingle"),
                env=env,
            )
            wait_http(api + "/api/v1/", watch=serve, timeout=60.0)
            ring = LOGS / "table-keys"
            ring.write_text(
                f"{settings.FEDINFER_TABLE_SIGNING_KEY_ID}={settings.FEDINFER_TABLE_SIGNING_KEY}"
            )
            ring.chmod(0o600)
            cred = LOGS / "cred"
            cred.write_text(credential)
            proc = group.start(
                "edge",
                fedinfer_argv(
                    "edge", "--region", REGION, "--control-plane", api, "--credential-file",
                    str(cred), "--table-keys-file", str(ring), "--edge-name", f"edge-{REGION}",
                    "--state-dir", str(LOGS / "state"), "--port", str(edge_port),
                    "--operator-port", str(ops_port), "--heartbeat-interval", "1",
                    "--log-level", "warning",
                ),
                env=env,
            )  # fmt: skip
            wait_http(f"http://127.0.0.1:{ops_port}/healthz", watch=proc, ready=http_ok)
            edge = f"http://127.0.0.1:{edge_port}"
            load_before = os.getloadavg()
            for i in range(reps):
                results.append(one_cold_start(edge, key, deployment_id, i))
            for i in range(adapters):
                loads.append(one_adapter(edge, key, i))
        finally:
            group.stop_all()
            provisioner = LocalProvisioner(Path(engines_dir))
            for name in provisioner.running():
                provisioner.stop(name)
    return {
        "date": utc_now(),
        "git": git_rev(),
        "machine": machine_info(),
        "loadavg_before": load_before,
        "idle_s": idle_s,
        "autoscale_interval_s": autoscale_every,
        "cold_starts": results,
        "adapter_loads": loads,
    }


def report(result: dict[str, Any]) -> str:
    """The result as the Markdown tables of docs/benchmarks.md."""
    rows = []
    for label, key in (
        ("first request -> autoscaler scales from zero", "decided"),
        ("first request -> instance ready", "ready"),
        ("**first request -> first token (cold start)**", "first_token"),
        ("warm request -> first token (same run)", "warm_first_token"),
    ):
        vals = [r[key] for r in result["cold_starts"]]
        rows.append(
            [
                label,
                len(vals),
                fmt(percentile(vals, 50) * 1000, 0),
                fmt(max(vals) * 1000, 0),
            ]
        )
    for label, key in (
        ("adapter request -> loaded onto the running replica", "loaded"),
        ("**adapter request -> first token**", "first_token"),
    ):
        vals = [r[key] for r in result.get("adapter_loads") or []]
        if vals:
            rows.append(
                [label, len(vals), fmt(percentile(vals, 50) * 1000, 0), fmt(max(vals) * 1000, 0)]
            )
    return markdown_table(["figure", "n", "p50 ms", "max ms"], rows)


def main(argv: list[str]) -> None:
    """Run the cold starts; print the tables and write the JSON under var/bench/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="cold starts")
    parser.add_argument("--adapters", type=int, default=3, help="adapter loads on demand")
    parser.add_argument("--idle", type=int, default=3, help="scale_to_zero_after_s")
    parser.add_argument(
        "--autoscale-interval", type=int, default=10, help="the periodic autoscale pass, seconds"
    )
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL", ""))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    opts = parser.parse_args(argv)
    if not opts.database_url.startswith("postgres") or not opts.redis_url:
        raise SystemExit("needs --database-url postgres://... and --redis-url (or the env vars)")
    result = run(
        opts.reps,
        opts.adapters,
        opts.idle,
        opts.autoscale_interval,
        opts.database_url,
        opts.redis_url,
    )
    path = write_result("cold_start", result)
    print(report(result))
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
