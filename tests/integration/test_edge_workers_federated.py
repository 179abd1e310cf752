"""An edge of two worker processes on the control plane's signed tables (real processes on
loopback: ``fedinfer serve``, ``fedinfer engine-sim``, ``fedinfer edge --workers 2``): one
registered edge whose workers each heartbeat, are leased a budget and are counted in the
table, and whose usage arrives signed by each worker."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from django.db.models import Count
from django.utils import timezone
from rest_framework.test import APIClient

from federation.inventory import services as inventory
from federation.inventory.models import Edge, Instance
from federation.metering.models import UsageRecord
from federation.metering.pricing import Price
from federation.metering.services import model_price_set
from federation.routing import services as routing
from federation.routing.models import BudgetReport, RoutingTableVersion
from federation.tenancy import services as tenancy
from regions.supervisor import Supervisor, free_port, free_ports, wait_http
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

REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)
EDGE = "edge-eu-west"


@pytest.fixture(autouse=True)
def redis_11(settings: Any) -> Iterator[None]:
    with own_redis(settings, REDIS_URL):
        yield


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.django_db(transaction=True)
def test_two_workers_are_one_edge_with_two_holders(
    procs: Supervisor, admin_client: APIClient
) -> None:
    env = subprocess_env(REDIS_URL)
    engine_port = free_port()
    engine = procs.start(
        "engine",
        [FEDINFER, "engine-sim", "--port", str(engine_port), "--log-level", "warning"],
        env=env,
    )
    region = make_region("eu-west", "EU")
    model = make_model()
    price = Price(Decimal("0.10"), Decimal("0.01"), Decimal("0.40"))
    model_price_set(
        actor=None, model=model, price=price, effective_from=timezone.now() - timedelta(days=1)
    )
    dep = make_deployment(model, make_pool(region))
    make_instance(dep, "eu-west-0", "ready", endpoint_url=f"http://127.0.0.1:{engine_port}")
    port = free_port()
    edge = inventory.edge_register(
        actor=None, region=region, name=EDGE, url=f"http://127.0.0.1:{port}"
    )
    r = admin_client.post(f"/api/v1/edges/{edge.pk}/rotate-credential")
    assert r.status_code == 200, r.content
    acme = tenancy.tenant_create(
        actor=None, slug="acme", name="Acme", monthly_budget_usd=Decimal("100.00")
    )
    key = tenancy.api_key_create(actor=None, tenant=acme, name="k").plaintext
    routing.routing_tables_publish()
    wait_http(f"http://127.0.0.1:{engine_port}/health", watch=engine)

    cp, _ = serve(procs, env)
    ops = free_ports(2)
    spool = procs.log_dir / "spool"
    proc = start_control_plane_edge(
        procs,
        region="eu-west",
        control_plane=cp,
        credential=r.json()["credential"],
        table_keys=write_table_keys(procs.log_dir / "table-keys"),
        port=port,
        ops_port=ops[0],
        env=env,
        args=("--workers", "2", "--peer-redis-url", REDIS_URL, "--usage-spool-dir", str(spool),
              "--usage-flush-interval", "0.05"),
    )  # fmt: skip
    for ops_port in ops:
        wait_http(f"http://127.0.0.1:{ops_port}/healthz", watch=proc)

    # Both workers heartbeat as the one edge; the table that follows counts two processes
    # and leases the budget to each.
    def both_reported() -> bool:
        load = Instance.objects.get(name="eu-west-0").load or {}
        return set(load.get("edges", {})) == {EDGE, f"{EDGE}.1"}

    wait_for(both_reported, "both workers' instance reports")
    assert Edge.objects.get(name=EDGE).workers == 2
    routing.routing_tables_publish()
    table = RoutingTableVersion.objects.filter(region=region).order_by("-version").first()
    assert table is not None and table.document["local_edges"] == 2
    (tenant,) = [t for t in table.document["tenants"] if t["tenant"] == "acme"]
    assert set(tenant["budget"]["tenant"]["leases"]) == {EDGE, f"{EDGE}.1"}

    # Each worker applies it and reports on it under its own name.
    def both_applied() -> bool:
        versions = dict(BudgetReport.objects.values_list("holder", "table_version"))
        return versions == {EDGE: table.version, f"{EDGE}.1": table.version}

    wait_for(both_applied, "both workers on the new table")

    # Requests on connections of their own reach both workers, within their leases; each
    # worker's usage arrives signed with its name.
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": LLAMA_8B["name"], "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8}  # fmt: skip
    for n in range(30):
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=20)
        assert r.status_code == 200, (n, r.text)

    def all_metered() -> bool:
        return UsageRecord.objects.count() == 30

    wait_for(all_metered, "the 30 usage records")
    by_holder = dict(UsageRecord.objects.values_list("edge").annotate(n=Count("*")))
    assert set(by_holder) == {EDGE, f"{EDGE}.1"}, by_holder
