"""The autoscaler end to end on loopback: a real ``fedinfer worker`` (Celery with embedded beat
on this test's Redis DB and PostgreSQL database) whose local provisioner starts ``fedinfer
engine-sim`` processes, ``fedinfer serve`` and a ``fedinfer edge`` reporting load in its
heartbeats.

* the load rises to every slot busy → a second replica is started (loading or warming) at once
  (no waiting for the smoothed load), while no request has waited at the edge for a slot (the
  edge's ``server-timing: queue``): the next one would be the first to queue, the first whose
  time to first token grows;
* the load drops → one replica is removed, not before the cooldown, and drained first: its long
  streams are moved to the other replica within seconds (``--drain-migrate-after``) and finish
  intact there, so its engine stops without waiting for them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from federation.core.models import AuditEvent
from federation.fleet.models import DeploymentAutoscale
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Instance
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
    ready,
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
SLOTS = 4  # max-num-seqs: requests one replica runs at once
COOLDOWN_S = 12
DOWN_WINDOW_S = 3
#: Time a request may spend in the edge's line and still count as not having waited for a slot
#: (it is admitted at once when a slot is free; this is scheduling noise on a loaded machine).
NO_WAIT_S = 0.25


def env(engines_dir: Path) -> dict[str, str]:
    return subprocess_env(
        REDIS_URL,
        FEDINFER_LOCAL_ENGINES_DIR=str(engines_dir),
        FEDINFER_FLEET_INTERVAL_SECONDS="1",
        FEDINFER_FLEET_DRAIN_TIMEOUT_SECONDS="120",  # a drain ends when its streams do
        FEDINFER_AUTOSCALE_DOWN_WINDOW_SECONDS=str(DOWN_WINDOW_S),
        FEDINFER_AUTOSCALE_COOLDOWN_SECONDS=str(COOLDOWN_S),
    )


@dataclass
class Stream:
    """One long streamed completion through the edge, read on a thread until it ends or is
    told to stop; what it saw."""

    url: str
    key: str
    max_tokens: int
    stop: threading.Event = field(default_factory=threading.Event)
    routed_to: str = ""
    queue_s: float | None = None  # its wait at the edge for a slot (server-timing)
    ttft_s: float | None = None
    chunks: int = 0
    finished: bool = False  # the engine's [DONE] arrived
    ended_at: float = 0.0
    error: str = ""

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        body = {
            "model": LLAMA,
            # A prompt of its own: no prefix affinity pulls the streams onto one replica.
            "messages": [{"role": "user", "content": f"{id(self)} tell me a long story"}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            with httpx.stream("POST", self.url, json=body, headers=headers, timeout=60) as r:
                if r.status_code != 200:
                    self.error = f"{r.status_code} {r.read()[:200]!r}"
                    return
                self.routed_to = r.headers.get("x-fedinfer-route", "")
                timing = dict(
                    part.strip().split(";dur=", 1)
                    for part in r.headers.get("server-timing", "").split(",")
                    if ";dur=" in part
                )
                self.queue_s = float(timing["queue"]) / 1000 if "queue" in timing else None
                for line in r.iter_lines():
                    if self.ttft_s is None and line.startswith("data: {"):
                        self.ttft_s = time.monotonic() - started
                    if line.startswith("data: {"):
                        self.chunks += 1
                    if line == "data: [DONE]":
                        self.finished = True
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as exc:
            self.error = f"{exc.__class__.__name__}: {exc}"
        finally:
            self.ended_at = time.time()  # wall clock: compared with audit events

    def on(self, instance: str) -> bool:
        """Whether the edge sent it to ``instance`` (the route header also names the runner-up)."""
        fields = dict(part.split("=", 1) for part in self.routed_to.split(";") if "=" in part)
        return fields.get("instance") == instance

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def edge_idle_on(ops_port: int, instances: set[str]) -> bool:
    """Whether the edge's scheduler sees every one of ``instances`` healthy with nothing in
    flight (its operator ``/healthz``)."""
    detail = httpx.get(f"http://127.0.0.1:{ops_port}/healthz", timeout=5).json()["detail"]
    idle = {i for i, v in detail.items() if v["healthy"] and v["inflight"] == 0}
    return all(any(name in i for i in idle) for name in instances)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_load_up_starts_a_replica_in_time_load_down_drains_one_after_the_cooldown(
    procs: Supervisor,
    engines: LocalProvisioner,  # noqa: F811
) -> None:
    eu = make_region("eu-west", "EU")
    dep = make_deployment(
        make_model(),
        make_pool(eu, provisioner="local"),
        min_replicas=1,
        desired_replicas=1,
        max_replicas=3,
        autoscale=True,
        engine_args={"max-num-seqs": SLOTS},
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
    wait_until(lambda: len(ready(dep)) == 1, 60, "the first replica ready", log)
    (first,) = ready(dep)
    start_control_plane_edge(
        procs,
        region="eu-west",
        control_plane=cp,
        credential=credential,
        table_keys=write_table_keys(procs.log_dir / "table-keys"),
        port=edge_port,
        ops_port=ops_port,
        env=env(engines.engines_dir),
    )
    url = f"http://127.0.0.1:{edge_port}/v1/chat/completions"
    probe = Stream(url, key, max_tokens=2)
    probe.thread.join(30)
    deadline = time.monotonic() + 20
    while not probe.finished:  # the edge's first table may take a moment
        assert time.monotonic() < deadline, probe.error
        time.sleep(0.2)
        probe = Stream(url, key, max_tokens=2)
        probe.thread.join(30)
    assert probe.on(first)
    # Idle at the minimum: the autoscaler sees the load and has no replica to spare.
    wait_until(
        lambda: DeploymentAutoscale.objects.filter(
            deployment=dep, reason="below the band, no replica to spare"
        ).exists(),
        20,
        "the autoscaler seeing the idle replica",
        log,
    )
    assert states(dep) == {first: "ready"}
    assert Deployment.objects.get(pk=dep.pk).desired_replicas == 1

    # 1. Load up: every slot busy (100 %, above the 60-70 % band), nobody queued yet.
    loaded_at = time.monotonic()
    load = [Stream(url, key, max_tokens=30_000) for _ in range(SLOTS)]
    up = wait_until(
        lambda: any(s in ("pending", "loading", "warming") for s in states(dep).values()),
        30,
        "a second replica coming up",
        log,
    )
    print(f"load step -> new instance starting: {up:.2f} s")
    assert up <= 15
    event = AuditEvent.objects.get(action="fleet.autoscale")
    assert event.changes["desired_replicas"] == [1, 2] and event.actor_repr == "system"
    assert "every slot busy" in event.changes["reason"]
    for s in load:
        assert not s.error and s.queue_s is not None and s.queue_s < NO_WAIT_S, s
        assert s.on(first) and not s.finished  # still streaming: the load is still there
    for s in load:
        s.close()
    assert time.monotonic() - loaded_at < 60
    wait_until(lambda: len(ready(dep)) == 2, 60, "the second replica ready", log)
    (second,) = ready(dep) - {first}
    scaled_up_at = event.created_at
    # The load is gone once the edge has seen the closed streams end (it frees their slots when
    # it notices the disconnect) and routes to the second replica; on a loaded machine either
    # can lag the client's close by seconds, and a stream sent before then waits for a slot.
    wait_until(
        lambda: edge_idle_on(ops_port, {first, second}),
        30,
        "the edge idle and routing to both replicas",
        log,
    )

    # 2. Load down: one stream on each replica (25 %, below the band). After the down window
    # and the cooldown one replica drains; its stream ends intact before its engine stops.
    streams: list[Stream] = []
    while not (any(s.on(first) for s in streams) and any(s.on(second) for s in streams)):
        assert len(streams) < 8, [s.routed_to for s in streams]
        streams.append(Stream(url, key, max_tokens=3000))
        wait_until(lambda: streams[-1].routed_to or streams[-1].error, 10, "routed", log)
        assert not streams[-1].error, streams[-1].error
    assert len(streams) * 1.0 / (2 * SLOTS) < 0.6
    wait_until(
        lambda: AuditEvent.objects.filter(action="fleet.autoscale").count() == 2,
        COOLDOWN_S + 30,
        "scaled down",
        log,
    )
    down = AuditEvent.objects.filter(action="fleet.autoscale").latest("pk")
    assert down.changes["desired_replicas"] == [2, 1] and "below" in down.changes["reason"]
    assert (down.created_at - scaled_up_at).total_seconds() >= COOLDOWN_S
    wait_until(lambda: "draining" in states(dep).values(), 10, "a replica draining", log)
    (leaving,) = [n for n, s in states(dep).items() if s == "draining"]
    assert Instance.objects.get(name=leaving).drain_reason == "scale_down"
    on_leaving = [s for s in streams if s.on(leaving)]
    assert on_leaving and any(not s.finished for s in on_leaving)  # it drains while serving
    wait_until(lambda: states(dep)[leaving] == "stopped", 90, "the drained replica stopped", log)
    drained = AuditEvent.objects.get(
        action="instance.transition", object_repr=leaving, changes__state=["ready", "draining"]
    )
    stopped = AuditEvent.objects.get(
        action="instance.transition", object_repr=leaving, changes__state=["draining", "stopped"]
    )
    print(f"scale-down {(down.created_at - scaled_up_at).total_seconds():.1f} s after scale-up")
    # Its long streams did not hold the drain up: the edge moved them to the other replica
    # (--drain-migrate-after, 1 s by default), where they went on and ended intact.
    drain_s = (stopped.created_at - drained.created_at).total_seconds()
    print(f"drained in {drain_s:.1f} s")
    assert drain_s <= 5.0
    for s in on_leaving:
        s.thread.join(60)
        assert s.finished and not s.error and s.ended_at > stopped.created_at.timestamp(), s
    (staying,) = {first, second} - {leaving}
    assert states(dep)[staying] == "ready"
    wait_until(lambda: len(ps_engines(engines)) == 1, 15, "one engine process left", log)
    assert set(engines.running()) == {staying}
    for s in streams:  # the staying replica's streams were never disturbed either
        s.thread.join(60)
        assert s.finished and not s.error, s
