"""Scale to zero and back, end to end on loopback: a real ``fedinfer worker`` (Celery on this
test's Redis DB and PostgreSQL database) whose local provisioner starts ``fedinfer engine-sim``
processes, ``fedinfer serve`` and a ``fedinfer edge`` on the control plane's signed tables.

* a deployment at zero is a cold model in its region's table: the edge lists it, holds its
  first requests (at most ``HOLD`` of them: a burst beyond gets 503 ``model_cold`` with
  ``Retry-After`` at once), reports them in its heartbeat — which queues the autoscale pass at
  once, well before the periodic one — and releases them to the replica once it is ready;
* left idle, the deployment goes back to zero instances (drained, engine stopped) with no
  request failed, and the next request wakes it again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

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
    ps_engines,
    redis_of_this_test,
    states,
    wait_until,
)
from tests.integration.inventory_factories import (
    LLAMA_8B,
    make_deployment,
    make_model,
    make_pool,
    make_region,
)
from workers.provisioners.local import LocalProvisioner

LLAMA = LLAMA_8B["name"]
#: Requests the edge holds per cold model; the hold's bound in seconds.
HOLD = 3
HOLD_MAX_S = 30
IDLE_S = 4
#: The periodic autoscale pass: much slower than the wake a heartbeat queues.
AUTOSCALE_EVERY_S = 10


def env(engines_dir: Path) -> dict[str, str]:
    return subprocess_env(
        REDIS_URL,
        FEDINFER_LOCAL_ENGINES_DIR=str(engines_dir),
        FEDINFER_FLEET_INTERVAL_SECONDS="1",
        FEDINFER_AUTOSCALE_INTERVAL_SECONDS=str(AUTOSCALE_EVERY_S),
        FEDINFER_AUTOSCALE_DOWN_WINDOW_SECONDS="2",
        FEDINFER_AUTOSCALE_COOLDOWN_SECONDS="3",
        FEDINFER_COLD_START_DEFAULT_SECONDS=str(HOLD_MAX_S),
    )


@dataclass
class Call:
    """One chat completion through the edge, on a thread; what it got."""

    url: str
    key: str
    status: int = 0
    retry_after: str | None = None
    code: str = ""
    seconds: float = 0.0
    error: str = ""

    def __post_init__(self) -> None:
        self.sent_at = time.time()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": LLAMA, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        started = time.monotonic()
        try:
            r = httpx.post(
                self.url, json=body, headers={"Authorization": f"Bearer {self.key}"}, timeout=60
            )
        except httpx.HTTPError as exc:
            self.error = f"{exc.__class__.__name__}: {exc}"
            return
        self.seconds = time.monotonic() - started
        self.status = r.status_code
        self.retry_after = r.headers.get("retry-after")
        if r.status_code != 200:
            self.code = r.json()["error"]["code"]

    def result(self) -> Call:
        self.thread.join(HOLD_MAX_S + 30)
        return self


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_cold_model_is_held_woken_served_and_scaled_back_to_zero(
    procs: Supervisor,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    eu = make_region("eu-west", "EU")
    dep = make_deployment(
        make_model(),
        make_pool(eu, provisioner="local"),
        min_replicas=0,
        desired_replicas=0,
        max_replicas=2,
        autoscale=True,
        scale_to_zero_after_s=IDLE_S,
        engine_args={"max-num-seqs": 4},
    )
    edge_port, ops_port = free_port(), free_port()
    edge = inventory.edge_register(
        actor=None, region=eu, name="edge-eu-west", url=f"http://127.0.0.1:{edge_port}"
    )
    credential = routing.edge_credential_rotate(actor=None, edge=edge)
    tenant = tenancy.tenant_create(actor=None, slug="anyone", name="Anyone")
    key = tenancy.api_key_create(actor=None, tenant=tenant, name="k").plaintext
    routing.routing_tables_publish()

    argv = [FEDINFER, "worker", "--pool", "solo", "--without-gossip", "--without-mingle"]
    worker: Process = procs.start("worker", argv, env=env(engines.engines_dir))
    log = worker.log
    cp, _ = serve(procs, env(engines.engines_dir))
    start_control_plane_edge(
        procs,
        region="eu-west",
        control_plane=cp,
        credential=credential,
        table_keys=write_table_keys(procs.log_dir / "table-keys"),
        port=edge_port,
        ops_port=ops_port,
        env=env(engines.engines_dir),
        args=("--cold-hold-requests", str(HOLD), "--cold-hold-max", str(HOLD_MAX_S)),
    )
    base = f"http://127.0.0.1:{edge_port}"
    auth = {"Authorization": f"Bearer {key}"}

    def listed() -> bool:
        try:
            r = httpx.get(f"{base}/v1/models", headers=auth, timeout=2)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and LLAMA in [m["id"] for m in r.json()["data"]]

    # 1. At zero the model is known (listed), cold: nothing runs.
    wait_until(listed, 30, "the edge listing the cold model", log)
    assert states(dep) == {} and ps_engines(engines) == []

    # 2. A burst over the hold bound: HOLD requests held, the rest refused at once.
    url = f"{base}/v1/chat/completions"
    burst = [Call(url, key) for _ in range(HOLD + 2)]
    first_at = min(c.sent_at for c in burst)
    refused = []
    wait_until(lambda: sum(c.status == 503 for c in burst) >= 2, 10, "two refusals", log)
    for c in burst:
        if c.status == 503:
            refused.append(c)
            assert c.code == "model_cold" and c.retry_after is not None, c
            assert 1 <= int(c.retry_after) <= HOLD_MAX_S + 10 and c.seconds < 2, c
    assert len(refused) == 2
    # The heartbeat woke it: the autoscale pass ran at once, not at its periodic turn.
    woke = wait_until(
        lambda: AuditEvent.objects.filter(action="fleet.autoscale").exists(), 10, "woken", log
    )
    event = AuditEvent.objects.get(action="fleet.autoscale")
    assert event.changes["desired_replicas"] == [0, 1] and "held" in event.changes["reason"]
    wake_s = event.created_at.timestamp() - first_at
    print(f"first held request -> scaled from zero: {wake_s:.2f} s (waited {woke:.2f} s)")
    assert wake_s < AUTOSCALE_EVERY_S / 2

    # 3. The held requests are served by the new replica within the hold bound.
    held = [c.result() for c in burst if c not in refused]
    for c in held:
        assert c.status == 200 and not c.error, c
        assert c.seconds < HOLD_MAX_S, c
    cold_start = max(c.seconds for c in held)
    print(f"cold start to answer (held requests): {cold_start:.2f} s")
    (replica,) = [n for n, s in states(dep).items() if s == "ready"]
    assert len(ps_engines(engines)) == 1

    # 4. Idle: back to zero instances — drained, engine stopped — with no request failed.
    wait_until(
        lambda: Deployment.objects.get(pk=dep.pk).desired_replicas == 0,
        IDLE_S + 3 * AUTOSCALE_EVERY_S,
        "scaled to zero",
        log,
    )
    down = AuditEvent.objects.filter(action="fleet.autoscale").latest("pk")
    assert down.changes["desired_replicas"] == [1, 0] and "no demand" in down.changes["reason"]
    wait_until(lambda: states(dep)[replica] == "stopped", 60, "the replica stopped", log)
    wait_until(lambda: ps_engines(engines) == [], 15, "no engine process left", log)
    assert listed()  # cold again, still known

    # 5. The next request wakes it again and is served.
    again = Call(url, key).result()
    assert again.status == 200 and not again.error, again
    print(f"second cold start to answer: {again.seconds:.2f} s")
    ups = AuditEvent.objects.filter(action="fleet.autoscale").order_by("pk")
    assert [e.changes["desired_replicas"] for e in ups] == [[0, 1], [1, 0], [0, 1]]
