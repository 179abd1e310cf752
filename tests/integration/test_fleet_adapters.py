"""A LoRA adapter loaded where its demand appears, end to end on loopback: a real ``fedinfer
worker`` (Celery on this test's Redis DB and PostgreSQL) with the local provisioner's
``fedinfer engine-sim``, ``fedinfer serve`` and a control-plane ``fedinfer edge``.

The adapter is registered for the base model but on no deployment: the region's table lists it
as cold, the edge holds a request for it and reports it, the heartbeat queues the autoscale
task, which loads it onto the running replica with vLLM's runtime ``/v1/load_lora_adapter``
and adds it to the deployment; the next table lists it and the held request is served — no
restart of the engine.
"""

from __future__ import annotations

import time

import httpx
import pytest

from federation.core.models import AuditEvent
from federation.inventory import services as inventory
from federation.inventory.models import Deployment
from federation.routing import services as routing
from federation.tenancy import services as tenancy
from regions.supervisor import Process, Supervisor, free_port
from tests.integration.control_plane_support import (
    FEDINFER,
    serve,
    start_control_plane_edge,
    subprocess_env,
    write_table_keys,
)
from tests.integration.fleet_support import (  # noqa: F401
    REDIS_URL,
    engines,
    redis_of_this_test,
    states,
    wait_until,
)
from tests.integration.inventory_factories import (
    make_deployment,
    make_model,
    make_pool,
    make_region,
)
from workers.provisioners.local import LocalProvisioner

ADAPTER = "sql-lora"


@pytest.mark.django_db(transaction=True)
def test_an_adapter_is_loaded_onto_the_running_replica_where_its_requests_arrive(
    procs: Supervisor,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    eu = make_region("eu-west", "EU")
    model = make_model()
    inventory.adapter_create(
        actor=None, base_model=model, name=ADAPTER, rank=16, source="/models/sql-lora"
    )
    dep = make_deployment(model, make_pool(eu, provisioner="local"), max_replicas=1)
    edge_port, ops_port = free_port(), free_port()
    edge = inventory.edge_register(
        actor=None, region=eu, name="edge-eu-west", url=f"http://127.0.0.1:{edge_port}"
    )
    credential = routing.edge_credential_rotate(actor=None, edge=edge)
    tenant = tenancy.tenant_create(actor=None, slug="anyone", name="Anyone")
    key = tenancy.api_key_create(actor=None, tenant=tenant, name="k").plaintext
    env = subprocess_env(
        REDIS_URL,
        FEDINFER_LOCAL_ENGINES_DIR=str(engines.engines_dir),
        FEDINFER_FLEET_INTERVAL_SECONDS="1",
        FEDINFER_AUTOSCALE_INTERVAL_SECONDS="30",  # the wake is the heartbeat's
    )
    argv = [FEDINFER, "worker", "--pool", "solo", "--without-gossip", "--without-mingle"]
    worker: Process = procs.start("worker", argv, env=env)
    log = worker.log
    cp, _ = serve(procs, env)
    wait_until(lambda: "ready" in states(dep).values(), 60, "the replica ready", log)
    (replica,) = states(dep)
    routing.routing_tables_publish()
    start_control_plane_edge(
        procs,
        region="eu-west",
        control_plane=cp,
        credential=credential,
        table_keys=write_table_keys(procs.log_dir / "table-keys"),
        port=edge_port,
        ops_port=ops_port,
        env=env,
    )
    base = f"http://127.0.0.1:{edge_port}"
    auth = {"Authorization": f"Bearer {key}"}
    engine = engines.running()[replica].url
    pid = engines.running()[replica].detail["pid"]

    def listed(url: str, headers: dict[str, str]) -> set[str]:
        try:
            r = httpx.get(f"{url}/v1/models", headers=headers, timeout=2)
        except httpx.HTTPError:
            return set()
        return {m["id"] for m in r.json()["data"]} if r.status_code == 200 else set()

    wait_until(lambda: ADAPTER in listed(base, auth), 30, "the edge listing the adapter", log)
    assert ADAPTER not in listed(engine, {})  # known to the edge, not loaded anywhere

    sent = time.time()
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": ADAPTER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers=auth,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    answered = time.time() - sent
    assert r.json()["model"] == ADAPTER
    event = AuditEvent.objects.get(action="fleet.adapter_load")
    assert event.changes["adapter"] == ADAPTER and event.changes["instances"] == [replica]
    print(
        f"adapter request -> loaded: {event.created_at.timestamp() - sent:.2f} s, "
        f"answered: {answered:.2f} s"
    )
    assert event.created_at.timestamp() - sent < 15  # not the 30 s periodic pass
    assert [a.name for a in Deployment.objects.get(pk=dep.pk).adapters.all()] == [ADAPTER]
    assert ADAPTER in listed(engine, {})
    assert engines.running()[replica].detail["pid"] == pid  # loaded, not restarted
    assert states(dep) == {replica: "ready"}
