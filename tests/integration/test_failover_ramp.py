"""A region coming back gets its traffic back gradually, end to end on loopback.

Real PostgreSQL (this test's database, transactional so the subprocesses see committed rows),
Redis (this test worker's database: tests/isolation.py), a real ``fedinfer serve`` and
``fedinfer worker`` (the worker publishes every table here, including the ramp's steps), and per
region a
``fedinfer engine-sim`` and a ``fedinfer edge`` in control-plane mode:

* ``eu-west`` and ``us-west`` serve llama; ``us-east`` serves qwen only, so its llama traffic
  goes to ``eu-west`` (10 ms away) rather than ``us-west`` (40 ms).

The same 24 sessions of the unrestricted tenant ask at the ``eu-west`` edge (its own traffic)
and at the ``us-east`` edge (failover traffic that moved) in rounds. Evacuating ``eu-west``
moves all of it away; after the restore the share served in ``eu-west`` rises in steps over the
ramp window (12 s here), a session once back stays back, and a restore -> evacuate -> restore
cycle starts the ramp again instead of flipping back to full. Then its engine dies: the region
is reported down, and when the engine comes back the health-driven ramp returns traffic the
same gradual way.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings
from rest_framework.test import APIClient

from federation.inventory import services as inventory
from federation.routing import services as routing
from federation.routing.models import RoutingTableVersion
from federation.telemetry import heartbeats
from federation.tenancy import services as tenancy
from regions.supervisor import Process, Supervisor, free_port, wait_http
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
from tests.integration.test_edge_support import (
    instance,
    route_of,
    spawn_engine,
    start_edge,
    table_doc,
)
from tests.integration.test_routing_distribution import (
    build_fleet,
)

REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)
LLAMA = LLAMA_8B["name"]
QWEN = "Qwen/Qwen2.5-7B-Instruct"
RAMP_S = 12
STEPS = 4
SESSIONS = [f"session-{i}" for i in range(24)]


@pytest.fixture(autouse=True)
def redis_of_this_test(settings: Any) -> Iterator[None]:
    with own_redis(settings, REDIS_URL):
        yield


def env() -> dict[str, str]:
    return subprocess_env(
        REDIS_URL,
        FEDINFER_RAMP_SECONDS=str(RAMP_S),
        FEDINFER_RAMP_STEPS=str(STEPS),
        FEDINFER_TABLES_REFRESH_SECONDS="60",  # the ramp's steps must not need beat
    )


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def served_in(client: httpx.Client, edge: str, key: str) -> set[str]:
    """The sessions (of :data:`SESSIONS`) served in eu-west, asking at ``edge``."""
    out = set()
    for session in SESSIONS:
        r = client.post(
            edge + "/v1/chat/completions",
            json={"model": LLAMA, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            headers={"Authorization": f"Bearer {key}", "x-session-id": session},
        )
        assert r.status_code == 200, r.text
        if route_of(r.headers)["region"] == "eu-west":
            out.add(session)
    return out


Round = tuple[float, set[str], set[str]]


def ramp_rounds(
    client: httpx.Client, edges: dict[str, str], key: str, until: Callable[[Round], bool]
) -> list[Round]:
    """Rounds (seconds since now, sessions in eu-west from eu-west, from us-east) until
    ``until`` holds for one, or the window plus 10 s."""
    started = time.monotonic()
    rounds: list[Round] = []
    while time.monotonic() - started < RAMP_S + 10:
        rnd = (
            time.monotonic() - started,
            served_in(client, edges["eu-west"], key),
            served_in(client, edges["us-east"], key),
        )
        rounds.append(rnd)
        if until(rnd):
            return rounds
    raise AssertionError(f"ramp did not finish: {[(t, len(a), len(b)) for t, a, b in rounds]}")


def full(rnd: Round) -> bool:
    return len(rnd[1]) == len(rnd[2]) == len(SESSIONS)


def assert_gradual(rounds: list[Round]) -> None:
    """Each edge's share rises through intermediate values, sessions never leave again, and
    full comes no earlier than most of the window."""
    for side in (1, 2):
        shares = [len(r[side]) / len(SESSIONS) for r in rounds]
        partial = {s for s in shares if 0 < s < 1}
        assert len(partial) >= 2, shares  # a ramp, not a step
        assert min(s for s in shares if s > 0) <= 0.5, shares
        for before, after in itertools.pairwise(rounds):
            assert before[side] <= after[side], (before[0], before[side] - after[side])
    first_full = next(r[0] for r in rounds if full(r))
    assert first_full >= RAMP_S * 0.6, first_full


def test_a_returning_edge_forwards_above_its_ramp_and_serves_here_when_no_remote_answers(
    tmp_path: Path,
) -> None:
    """File mode, two edges: ``r1`` at ramp 0 sends its traffic to ``r2`` (``spill=ramp``);
    with ``r2`` unreachable it serves the request itself rather than failing it."""
    procs: list[Process] = []
    try:
        e1, e2 = spawn_engine(tmp_path, "e1"), spawn_engine(tmp_path, "e2")
        procs += [e1.proc, e2.proc]
        for engine in (e1, e2):
            wait_http(engine.url + "/health", watch=engine.proc)
        (tmp_path / "r2").mkdir()
        r2 = start_edge(tmp_path / "r2", table_doc("r2", 1, [instance(e2)]))
        procs.append(r2.proc)
        t1 = table_doc("r1", 1, [instance(e1)])
        t1.update(schema_version=2, ramp=0.0)
        t1["remote_regions"] = [
            {"code": "r2", "edge_url": r2.url, "rtt_ms": 5, "models": ["llama"], "headroom": 0.5}
        ]
        (tmp_path / "r1").mkdir()
        r1 = start_edge(tmp_path / "r1", t1)
        procs.append(r1.proc)

        def ask() -> httpx.Response:
            return httpx.post(
                r1.url + "/v1/chat/completions",
                json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
                headers={"x-session-id": "s1"},
                timeout=15,
            )

        r = ask()
        assert r.status_code == 200, r.text
        route = route_of(r.headers)
        assert (route["region"], route["remote_from"], route["spill"]) == ("r2", "r1", "ramp")

        t1 = {**t1, "version": 2}
        t1["remote_regions"] = [
            {**t1["remote_regions"][0], "edge_url": f"http://127.0.0.1:{free_port()}"}
        ]
        r1.table.with_suffix(".tmp").write_text(json.dumps(t1))
        r1.table.with_suffix(".tmp").replace(r1.table)
        wait_until(
            lambda: httpx.get(r1.ops + "/healthz").json()["table_version"] == 2, 5, "version 2"
        )
        r = ask()
        assert r.status_code == 200, r.text
        assert route_of(r.headers)["region"] == "r1" and route_of(r.headers)["instance"] == "e1"
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.mark.django_db
def test_heartbeats_taking_a_region_down_and_back_recompile_and_start_its_ramp(
    admin_client: APIClient, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    fleet = build_fleet(admin_client)
    routing.routing_tables_publish()

    def beat(healthy: bool) -> list[Any]:
        with django_capture_on_commit_callbacks() as callbacks:
            heartbeats.edge_heartbeat_record(
                edge=fleet.eu_edge,
                applied_table_version=1,
                instances=[heartbeats.InstanceReport(id="eu-west-0", healthy=healthy, load={})],
            )
        return callbacks

    assert beat(True) == []  # unknown -> healthy: no transition, no recompile
    assert len(beat(False)) == 1  # its only instance reported unhealthy: down
    assert beat(False) == []
    routing.routing_tables_publish()
    assert latest_ramp("eu-west") == 0.0
    fleet.eu.refresh_from_db()
    assert fleet.eu.recovered_at is None
    assert len(beat(True)) == 1  # back up: recompile, and the ramp starts now
    fleet.eu.refresh_from_db()
    assert fleet.eu.recovered_at is not None
    routing.routing_tables_publish()
    assert latest_ramp("eu-west") == pytest.approx(1 / (settings.FEDINFER_RAMP_STEPS + 1))
    assert latest_ramp("us-east") == 1.0


def latest_ramp(code: str) -> Any:
    doc = RoutingTableVersion.objects.filter(region__code=code).order_by("-version").first()
    return None if doc is None else doc.document.get("ramp", 1.0)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_region_coming_back_gets_its_traffic_back_gradually(
    procs: Supervisor, admin_client: APIClient
) -> None:
    codes = ("eu-west", "us-west", "us-east")
    serves = {"eu-west": LLAMA, "us-west": LLAMA, "us-east": QWEN}
    engine_ports = {c: free_port() for c in codes}

    def start_engine(code: str) -> Process:
        cmd = [FEDINFER, "engine-sim", "--port", str(engine_ports[code]), "--model", serves[code]]
        return procs.start(f"engine-{code}", [*cmd, "--log-level", "warning"], env=env())

    engines = {code: start_engine(code) for code in codes}
    regions = {c: make_region(c, "EU" if c == "eu-west" else "US") for c in codes}
    models = {LLAMA: make_model(), QWEN: make_model(name=QWEN)}
    rtt = {("us-east", "eu-west"): 10, ("us-east", "us-west"): 40, ("eu-west", "us-west"): 40}
    for (a, b), ms in rtt.items():
        for src, dst in ((a, b), (b, a)):
            inventory.region_link_set(
                actor=None, source=regions[src], target=regions[dst], rtt_ms=ms
            )
    for code in codes:
        dep = make_deployment(models[serves[code]], make_pool(regions[code]))
        make_instance(
            dep, f"{code}-0", "ready", endpoint_url=f"http://127.0.0.1:{engine_ports[code]}"
        )
    edge_ports = {c: free_port() for c in codes}
    edges = {c: f"http://127.0.0.1:{edge_ports[c]}" for c in codes}
    ops_ports = {c: free_port() for c in codes}
    credentials = {}
    for code in codes:
        edge = inventory.edge_register(
            actor=None, region=regions[code], name=f"edge-{code}", url=edges[code]
        )
        credentials[code] = routing.edge_credential_rotate(actor=None, edge=edge)
    anyone = tenancy.tenant_create(actor=None, slug="anyone", name="Anyone")
    key = tenancy.api_key_create(actor=None, tenant=anyone, name="k").plaintext
    routing.routing_tables_publish()

    cp, _ = serve(procs, env())
    worker_cmd = [FEDINFER, "worker", "--pool", "solo", "--without-gossip", "--without-mingle"]
    procs.start("worker", worker_cmd, env=env())

    def up(url: str) -> bool:
        try:
            return httpx.get(url, timeout=1).status_code < 500
        except httpx.TransportError:
            return False

    ring = write_table_keys(procs.log_dir / "table-keys")
    for code in codes:
        start_control_plane_edge(
            procs,
            region=code,
            control_plane=cp,
            credential=credentials[code],
            table_keys=ring,
            port=edge_ports[code],
            ops_port=ops_ports[code],
            env=env(),
        )
    for code in codes:
        url = f"http://127.0.0.1:{ops_ports[code]}/healthz"
        wait_until(lambda url=url: up(url), 20, f"edge {code}")

    with httpx.Client(timeout=20) as client:
        every = set(SESSIONS)
        assert served_in(client, edges["eu-west"], key) == every
        assert served_in(client, edges["us-east"], key) == every  # nearest llama region

        def evacuate() -> None:
            assert admin_client.post("/api/v1/regions/eu-west/evacuate/").status_code == 200
            wait_until(
                lambda: (
                    not served_in(client, edges["eu-west"], key)
                    and not served_in(client, edges["us-east"], key)
                ),
                10,
                "eu-west traffic to move away",
            )

        def restore() -> None:
            assert admin_client.post("/api/v1/regions/eu-west/restore/").status_code == 200

        # 1. Evacuate, restore: the share comes back in steps, at both edges.
        evacuate()
        restore()
        rounds = ramp_rounds(client, edges, key, full)
        print("restore:", [(round(t, 1), len(a), len(b)) for t, a, b in rounds])
        assert_gradual(rounds)

        # 2. Restore -> evacuate -> restore within the window: the ramp starts over.
        evacuate()
        restore()
        wait_until(lambda: bool(served_in(client, edges["eu-west"], key)), 5, "first step")
        evacuate()
        restore()
        rounds = ramp_rounds(client, edges, key, full)
        print("cycle:", [(round(t, 1), len(a), len(b)) for t, a, b in rounds])
        assert_gradual(rounds)

        # 3. eu-west loses its only engine: reported down (ramp 0) through the heartbeats; when
        #    the engine is back, the health-driven ramp returns the traffic gradually.
        procs.stop(engines["eu-west"])
        wait_until(lambda: latest_ramp("eu-west") == 0.0, 15, "eu-west reported down")
        assert not served_in(client, edges["eu-west"], key)
        assert not served_in(client, edges["us-east"], key)
        engines["eu-west"] = start_engine("eu-west")
        rounds = ramp_rounds(client, edges, key, full)
        print("recovery:", [(round(t, 1), len(a), len(b)) for t, a, b in rounds])
        assert_gradual(rounds)
