"""Three regions federated by the real control plane, end to end on loopback.

Real PostgreSQL (this test's database, transactional so the subprocesses see committed rows)
and Redis DB 13; a real ``fedinfer serve``; per region a ``fedinfer engine-sim`` and a
``fedinfer edge`` in control-plane mode (signed tables, persisted state, heartbeats).

* ``eu-west`` (EU): llama, one engine capped at one request (``max-num-seqs`` 1), no gateway
  queue — easy to saturate;
* ``us-east`` (US): llama;  ``us-west`` (US): qwen only.

Tenants (through the services): ``eu-only`` (jurisdiction EU) and ``anyone`` (no restriction).
Tables are published by calling the publishing service, as the worker does after each change
(the worker's debounce and its latency are covered in ``test_worker.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from rest_framework.test import APIClient

from federation.inventory import services as inventory
from federation.routing import services as routing
from federation.tenancy import services as tenancy
from regions.supervisor import Process, Supervisor, free_port
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
from tests.integration.test_edge_support import route_of

REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)
LLAMA = LLAMA_8B["name"]
QWEN = "Qwen/Qwen2.5-7B-Instruct"


@pytest.fixture(autouse=True)
def redis_13(settings: Any) -> Iterator[None]:
    with own_redis(settings, REDIS_URL):
        yield


def env() -> dict[str, str]:
    return subprocess_env(REDIS_URL)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def chat(edge: str, key: str, model: str = LLAMA, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(
        edge + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens,
        },
        headers={"Authorization": f"Bearer {key}"},
        timeout=20,
    )


def healthy(edge: str) -> int:
    return int(httpx.get(edge + "/healthz", timeout=1).json()["healthy_instances"])


def inflight(edge: str, instance: str) -> int:
    """The edge's own requests in flight on ``instance`` (its operator ``/healthz``)."""
    detail = httpx.get(edge + "/healthz", timeout=5).json()["detail"]
    return int(detail[instance]["inflight"])


def metric(edge: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(edge + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name):
            total += float(line.split()[-1])
    return total


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_three_regions_federated(procs: Supervisor, admin_client: APIClient) -> None:
    t_start = time.monotonic()
    codes = ("eu-west", "us-east", "us-west")
    # Engines first: their URLs go into the inventory.
    engine_ports = {c: free_port() for c in codes}
    serves = {"eu-west": LLAMA, "us-east": LLAMA, "us-west": QWEN}
    for code in codes:
        cmd = [FEDINFER, "engine-sim", "--port", str(engine_ports[code])]
        cmd += ["--model", serves[code], "--log-level", "warning"]
        if code == "eu-west":
            cmd += ["--max-num-seqs", "1"]
        procs.start(f"engine-{code}", cmd, env=env())

    regions = {
        "eu-west": make_region("eu-west", "EU", latitude=53.3, longitude=-6.3),
        "us-east": make_region("us-east", "US"),
        "us-west": make_region("us-west", "US", latitude=37.4, longitude=-122.1),
    }
    models = {LLAMA: make_model(), QWEN: make_model(name=QWEN)}
    for a in codes:
        for b in codes:
            if a != b:
                inventory.region_link_set(
                    actor=None, source=regions[a], target=regions[b], rtt_ms=20
                )
    for code in codes:
        args = {"max-num-seqs": 1} if code == "eu-west" else {}
        dep = make_deployment(models[serves[code]], make_pool(regions[code]), engine_args=args)
        make_instance(
            dep, f"{code}-0", "ready", endpoint_url=f"http://127.0.0.1:{engine_ports[code]}"
        )
    edge_ports = {c: free_port() for c in codes}
    credentials = {}
    for code in codes:
        edge = inventory.edge_register(
            actor=None,
            region=regions[code],
            name=f"edge-{code}",
            url=f"http://127.0.0.1:{edge_ports[code]}",
        )
        r = admin_client.post(f"/api/v1/edges/{edge.pk}/rotate-credential")
        assert r.status_code == 200, r.content
        credentials[code] = r.json()["credential"]
    eu_only = tenancy.tenant_create(
        actor=None, slug="eu-only", name="EU only", allowed_jurisdictions=["EU"]
    )
    anyone = tenancy.tenant_create(actor=None, slug="anyone", name="Anyone")
    eu_key = tenancy.api_key_create(actor=None, tenant=eu_only, name="k").plaintext
    any_key = tenancy.api_key_create(actor=None, tenant=anyone, name="k").plaintext
    routing.routing_tables_publish()

    cp, serve_proc = serve(procs, env())
    ring = write_table_keys(procs.log_dir / "table-keys")
    edges = {c: f"http://127.0.0.1:{edge_ports[c]}" for c in codes}
    ops_ports = {c: free_port() for c in codes}
    ops = {c: f"http://127.0.0.1:{ops_ports[c]}" for c in codes}

    def start_edge(code: str) -> Process:
        proc = start_control_plane_edge(
            procs,
            region=code,
            control_plane=cp,
            credential=credentials[code],
            table_keys=ring,
            port=edge_ports[code],
            ops_port=ops_ports[code],
            env=env(),
            args=("--queue-size", "0"),
        )
        wait_until(lambda: healthy(ops[code]) >= 1, 20, f"edge {code}")
        return proc

    edge_procs = {code: start_edge(code) for code in codes}

    # 1. Local when local serves it; the model missing here spills to an allowed region.
    r = chat(edges["eu-west"], any_key)
    assert r.status_code == 200 and route_of(r.headers)["region"] == "eu-west", r.headers
    r = chat(edges["eu-west"], any_key, QWEN)
    assert r.status_code == 200, r.text
    route = route_of(r.headers)
    assert (route["region"], route["remote_from"], route["spill"]) == (
        "us-west",
        "eu-west",
        "not_local",
    )
    # Residency: the EU-only tenant never gets qwen (served only in the US): the table refuses.
    r = chat(edges["eu-west"], eu_key, QWEN)
    assert r.status_code == 403 and "residency" in r.json()["error"]["message"]
    # Arriving at a US edge, the EU-only tenant is served in eu-west, never by a US instance.
    r = chat(edges["us-east"], eu_key)
    assert r.status_code == 200, r.text
    route = route_of(r.headers)
    assert (route["region"], route["remote_from"], route["spill"]) == (
        "eu-west",
        "us-east",
        "residency",
    )

    # 2. eu-west saturated: EU-only gets 503 with Retry-After, never a US instance; the
    #    unrestricted tenant spills to us-east.
    #    The held stream must outlast this step: without ``ignore_eos`` the simulated model
    #    stops "hold" by itself after ~130 tokens (~1.2 s), and a loaded machine took longer
    #    than that over the requests below, so eu-west's slot was free again and one was
    #    answered 200. With it, the stream runs to its 4000 tokens (~30 s) unless closed.
    spills_before = metric(ops["eu-west"], "fedinfer_edge_spills_total")
    with httpx.stream(
        "POST",
        edges["eu-west"] + "/v1/chat/completions",
        json={
            "model": LLAMA,
            "messages": [{"role": "user", "content": "hold"}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        },
        headers={"Authorization": f"Bearer {eu_key}"},
        timeout=30,
    ) as held:
        assert held.status_code == 200 and route_of(held.headers)["region"] == "eu-west"
        held_on = route_of(held.headers)["instance"]
        assert inflight(ops["eu-west"], held_on) == 1  # the one slot is the held stream's
        for _ in range(5):
            r = chat(edges["eu-west"], eu_key)
            assert r.status_code in (429, 503), r.text
            assert "retry-after" in r.headers
            assert route_of(r.headers)["region"] == "eu-west"
            assert route_of(r.headers)["instance"] == "none"
        assert metric(ops["eu-west"], "fedinfer_edge_spills_total") == spills_before
        r = chat(edges["eu-west"], any_key)
        assert r.status_code == 200
        assert route_of(r.headers)["region"] == "us-east", r.headers
        assert inflight(ops["eu-west"], held_on) == 1  # still held throughout
    assert metric(ops["eu-west"], "fedinfer_edge_spills_total") == spills_before + 1

    # 3. Evacuating eu-west through the API shifts its traffic within seconds.
    r = admin_client.post("/api/v1/regions/eu-west/evacuate/")
    assert r.status_code == 200, r.content
    evacuated_at = time.monotonic()
    routing.routing_tables_publish()

    def moved() -> bool:
        resp = chat(edges["eu-west"], any_key)
        return resp.status_code == 200 and route_of(resp.headers)["region"] != "eu-west"

    wait_until(moved, 10, "eu-west traffic to move")
    shift_s = time.monotonic() - evacuated_at
    r = chat(edges["eu-west"], eu_key)
    assert r.status_code in (403, 503)  # nowhere allowed: refused, never the US
    print(f"evacuation -> traffic shifted in {shift_s:.2f}s")
    assert shift_s < 5, shift_s
    r = admin_client.post("/api/v1/regions/eu-west/restore/")
    assert r.status_code == 200, r.content
    routing.routing_tables_publish()
    wait_until(
        lambda: route_of(chat(edges["eu-west"], eu_key).headers)["region"] == "eu-west",
        10,
        "eu-west restored",
    )

    # Heartbeats reached the control plane: each edge reports the version it applies.
    r = admin_client.get("/api/v1/routing-tables/")
    rows = {row["region"]: row for row in r.json()["results"]}
    for code in codes:
        (edge_row,) = rows[code]["edges"]
        wait_until(
            lambda code=code: (
                httpx.get(ops[code] + "/healthz").json()["table_version"]
                == rows[code]["latest_version"]
            ),
            5,
            f"{code} on the latest version",
        )
        assert edge_row["applied_table_version"] is not None

    # 4. A tampered persisted table is rejected (us-west), and with the control plane stopped
    #    every other edge keeps serving — also after a restart, from its persisted table.
    procs.stop(serve_proc)
    for code in codes:
        # eu-west is still ramping back after its restore (the unrestricted tenant returns in
        # steps, test_failover_ramp.py); the EU-only tenant is served there at once.
        key = eu_key if code == "eu-west" else any_key
        r = chat(edges[code], key, QWEN if code == "us-west" else LLAMA)
        assert r.status_code == 200 and route_of(r.headers)["region"] == code
        wait_until(
            lambda code=code: bool(httpx.get(ops[code] + "/healthz").json()["sync_error"]),
            5,
            f"{code} to notice the control plane is gone",
        )
    procs.stop(edge_procs["us-east"])
    edge_procs["us-east"] = start_edge("us-east")
    r = chat(edges["us-east"], any_key)
    assert r.status_code == 200 and route_of(r.headers)["region"] == "us-east"
    assert (
        json.loads(httpx.get(ops["us-east"] + "/healthz").text)["table_source"] == "control-plane"
    )

    procs.stop(edge_procs["us-west"])
    persisted = procs.log_dir / "state-us-west" / "routing-table.json"
    doc = json.loads(persisted.read_text())
    doc["instances"][0]["url"] = "http://127.0.0.1:1"
    persisted.write_text(json.dumps(doc))
    cred = procs.log_dir / "cred-us-west"
    out = subprocess.run(
        [FEDINFER, "edge", "--region", "us-west", "--control-plane", cp, "--credential-file",
         str(cred), "--table-keys-file", str(ring), "--state-dir", str(persisted.parent),
         "--port", str(free_port()), "--initial-timeout", "1"],
        capture_output=True, timeout=30, check=False, env=env(),
    )  # fmt: skip
    assert out.returncode != 0
    assert b"tampered" in out.stderr and b"none persisted" in out.stderr, out.stderr[-2000:]
    elapsed = time.monotonic() - t_start
    print(f"federation test: {elapsed:.1f}s")
    assert elapsed < 90
