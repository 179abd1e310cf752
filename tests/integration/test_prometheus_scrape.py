"""A real Prometheus (Debian's ``prometheus``) scraping a real control plane (with its metrics
token), worker, edge and engine on loopback, with the configuration ``fedinfer demo
--prometheus`` writes and the repository's alerting rules; the key series read back through
Prometheus's HTTP API: table version per region, an edge's request counter (by engine),
heartbeat age, the worker's tasks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rest_framework.test import APIClient

from federation.demo import prometheus
from federation.inventory import services as inventory
from federation.routing import services as routing
from federation.routing.models import RoutingTableVersion
from federation.tenancy import services as tenancy
from regions.supervisor import Supervisor, free_port, wait_http, wait_until
from tests.integration.control_plane_support import (
    FEDINFER,
    own_redis,
    serve,
    start_control_plane_edge,
    subprocess_env,
    write_table_keys,
)
from tests.integration.inventory_factories import (
    LLAMA_8B,
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)

LLAMA = LLAMA_8B["name"]
TOKEN = "metrics-token-of-this-test"


@pytest.fixture
def redis_url(settings: Any) -> Iterator[str]:
    with own_redis(settings, settings.REDIS_URL):
        yield settings.REDIS_URL


def query(base: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def eventually(base: str, promql: str, *, timeout: float = 40) -> list[dict[str, Any]]:
    """The query's result once it has one."""
    found: list[dict[str, Any]] = []

    def answered() -> bool:
        found[:] = query(base, promql)
        return bool(found)

    wait_until(answered, what=f"Prometheus to answer {promql}", timeout=timeout, interval=0.5)
    return found


@pytest.mark.django_db(transaction=True)
def test_prometheus_scrapes_every_process_and_answers_the_key_series(
    procs: Supervisor, redis_url: str, admin_client: APIClient, tmp_path: Path
) -> None:
    env = subprocess_env(redis_url)
    engine_port = free_port()
    engine_cmd = [FEDINFER, "engine-sim", "--port", str(engine_port), "--model", LLAMA]
    procs.start("engine", [*engine_cmd, "--log-level", "warning"], env=env)
    region = make_region("eu-west", "EU")
    dep = make_deployment(make_model(), make_pool(region))
    engine_url = f"http://127.0.0.1:{engine_port}"
    make_instance(dep, "eu-west-0", "ready", endpoint_url=engine_url)
    edge_port, ops_port = free_port(), free_port()
    edge = inventory.edge_register(
        actor=None, region=region, name="edge-eu-west", url=f"http://127.0.0.1:{edge_port}"
    )
    credential = routing.edge_credential_rotate(actor=None, edge=edge)
    tenant = tenancy.tenant_create(actor=None, slug="acme", name="Acme")
    key = tenancy.api_key_create(actor=None, tenant=tenant, name="k").plaintext
    routing.routing_tables_publish()

    control_plane, _ = serve(procs, {**env, "FEDINFER_METRICS_TOKEN": TOKEN})
    worker_port = free_port()
    worker_env = {
        **env,
        "FEDINFER_WORKER_METRICS_PORT": str(worker_port),
        "FEDINFER_TABLES_REFRESH_SECONDS": "1",
    }
    worker_argv = [FEDINFER, "worker", "--pool", "solo", "--without-gossip", "--without-mingle"]
    procs.start("worker", worker_argv, env=worker_env)
    start_control_plane_edge(
        procs,
        region="eu-west",
        control_plane=control_plane,
        credential=credential,
        table_keys=write_table_keys(tmp_path / "table-keys"),
        port=edge_port,
        ops_port=ops_port,
        env=env,
    )
    wait_http(f"http://127.0.0.1:{ops_port}/healthz", ready=lambda s: s == 200)
    wait_http(f"{engine_url}/health", ready=lambda s: s == 200)

    def served() -> bool:
        r = httpx.post(
            f"http://127.0.0.1:{edge_port}/v1/chat/completions",
            json={"model": LLAMA, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {key}"},
            timeout=20,
        )
        return r.status_code == 200

    wait_until(served, what="a completion through the edge", timeout=30, interval=0.3)

    token_file = tmp_path / "metrics-token"
    token_file.write_text(TOKEN)
    targets = prometheus.ScrapeTargets(
        control_plane=control_plane,
        token_file=token_file,
        worker=f"127.0.0.1:{worker_port}",
        edges={"eu-west": f"http://127.0.0.1:{ops_port}"},
        engines=[("eu-west", engine_url)],
    )
    config = prometheus.write_config(
        tmp_path / "prometheus.yml",
        prometheus.scrape_config(targets, rule_files=prometheus.rule_files(), interval_s=1),
    )
    listen = f"127.0.0.1:{free_port()}"
    argv = prometheus.prometheus_argv(
        prometheus.DEFAULT_BINARY, config=config, data_dir=tmp_path / "data", listen=listen
    )
    prom = procs.start("prometheus", argv)
    base = f"http://{listen}"
    wait_http(f"{base}/-/ready", ready=lambda s: s == 200, watch=prom)

    # Every process is scraped: the control plane with its token.
    jobs = ("fedinfer-control-plane", "fedinfer-worker", "fedinfer-edge", "fedinfer-engine")
    for job in jobs:
        (up,) = eventually(base, f'up{{job="{job}"}} == 1')
        assert up["value"][1] == "1", job

    latest = RoutingTableVersion.objects.filter(region=region).order_by("-version").first()
    assert latest is not None
    (version,) = eventually(base, 'fedinfer_cp_table_version{region="eu-west"}')
    assert int(version["value"][1]) >= latest.version

    (requests,) = eventually(base, 'fedinfer_edge_requests_total{status="200"}')
    labels = requests["metric"]
    assert (labels["region"], labels["engine"], labels["model"]) == ("eu-west", "eu-west-0", LLAMA)
    assert labels["instance"] == f"127.0.0.1:{ops_port}"  # the target, not the engine
    assert float(requests["value"][1]) >= 1

    (age,) = eventually(base, 'fedinfer_cp_edge_heartbeat_age_seconds{edge="edge-eu-west"}')
    assert age["metric"]["region"] == "eu-west"
    assert 0 <= float(age["value"][1]) < 10

    # The edge's long polls and heartbeats, counted by URL pattern in the ASGI web process.
    routes = {
        s["metric"]["route"]
        for s in eventually(base, 'fedinfer_cp_http_requests_total{status=~"200|304"}')
    }
    assert any("routing-table" in r for r in routes), routes
    assert any("heartbeat" in r for r in routes), routes

    publishes = 'fedinfer_worker_tasks_total{task="fedinfer.routing_tables.publish"}'
    (tasks,) = eventually(base, publishes)
    assert tasks["metric"]["outcome"] == "success"

    # The repository's rules are loaded and evaluated.
    rules = httpx.get(f"{base}/api/v1/rules", timeout=5).json()["data"]["groups"]
    assert {g["name"] for g in rules} == {
        "fedinfer-federation",
        "fedinfer-edges",
        "fedinfer-usage-trust",
    }
    assert query(base, 'ALERTS{alertstate="firing"}') == []  # a healthy fleet
