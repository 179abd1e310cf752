"""A real edge process in control-plane mode against a small fake control plane on loopback.

The fake speaks the distribution contract (``docs/distribution.md``): bearer credential,
ETag / If-None-Match, ``?wait=`` long-poll, heartbeats. The real control plane is exercised in
``test_routing_distribution.py``; here the edge's side is under test: apply, refuse a tampered
table, persist, start from the persisted table while the control plane is down.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from regions.supervisor import Process, free_port, start_process, wait_http
from regions.tables.signing import sign
from tests.integration.test_edge_support import (
    instance,
    spawn_engine,
    table_doc,
)

FAKE_CP = r"""
import asyncio, json, sys
from aiohttp import web

state = {"doc": None, "version": 0, "beats": [], "gets": 0}
CRED = "Bearer fe_secret"

async def table(request):
    if request.headers.get("Authorization") != CRED:
        return web.json_response({"detail": "bad credential"}, status=401)
    state["gets"] += 1
    inm = request.headers.get("If-None-Match", '"0"').strip('"')
    have = int(inm) if inm.isdigit() else 0
    wait = float(request.query.get("wait", "0"))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while state["version"] <= have:
        if state["doc"] is None and not wait:
            return web.Response(status=503, headers={"Retry-After": "1"})
        if loop.time() >= deadline:
            return web.Response(status=304)
        await asyncio.sleep(0.05)
    return web.Response(body=state["doc"], content_type="application/json",
                        headers={"ETag": f'"{state["version"]}"'})

async def publish(request):
    body = await request.read()
    state["doc"] = body
    state["version"] = json.loads(body)["version"]
    return web.json_response({"ok": True})

async def heartbeat(request):
    if request.headers.get("Authorization") != CRED:
        return web.json_response({"detail": "bad credential"}, status=401)
    state["beats"].append({"edge": request.match_info["name"], **(await request.json())})
    return web.json_response({"edge": request.match_info["name"]})

async def stats(request):
    return web.json_response({"beats": state["beats"], "gets": state["gets"]})

app = web.Application()
app.router.add_get("/api/v1/edges/{region}/routing-table", table)
app.router.add_post("/api/v1/edges/{name}/heartbeat", heartbeat)
app.router.add_post("/_publish", publish)
app.router.add_get("/_stats", stats)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""

KEY = "table-key-1"
API_KEY = "fi_synced"
#: A control-plane table always lists its tenants (``tenants: null`` is for file mode only).
TENANTS = [
    {"tenant": "t", "key_hashes": [hashlib.sha256(API_KEY.encode()).hexdigest()],
     "allowed_regions": ["r1"]}
]  # fmt: skip


def cp_doc(region: str, version: int, instances: list[dict[str, Any]]) -> dict[str, Any]:
    return {**table_doc(region, version, instances), "tenants": TENANTS}


def signed(doc: dict[str, Any], key: str = KEY) -> bytes:
    return orjson.dumps(sign(doc, key, "k1"))


class ControlPlane:
    def __init__(self, tmp: Path, port: int | None = None) -> None:
        script = tmp / "fake_cp.py"
        script.write_text(FAKE_CP)
        self.port = port or free_port()
        argv = [sys.executable, str(script), str(self.port)]
        self.proc = start_process("fake-cp", argv, log=tmp / "fake-cp.log", append=True)
        wait_http(f"{self.url}/_stats", watch=self.proc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def publish(self, body: bytes) -> None:
        httpx.post(f"{self.url}/_publish", content=body, timeout=5).raise_for_status()

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"{self.url}/_stats", timeout=5).json()
        return data


#: Edge port → its operator listener's port (/healthz, /metrics).
OPS_PORTS: dict[int, int] = {}


def ops_url(port: int) -> str:
    return f"http://127.0.0.1:{OPS_PORTS[port]}"


#: The edge's long-poll wait (``--sync-wait``).
LONG_POLL_S = 25


def start_synced_edge(tmp: Path, cp_url: str, state: Path, port: int) -> Process:
    cred = tmp / "cred"
    cred.write_text("fe_secret\n")
    keys = tmp / "table-keys"
    keys.write_text(f"k0=old\nk1={KEY}\n")
    fedinfer = str(Path(sys.executable).parent / "fedinfer")
    cmd = [fedinfer, "edge", "--region", "r1", "--control-plane", cp_url]
    cmd += ["--credential-file", str(cred), "--table-keys-file", str(keys)]
    cmd += ["--state-dir", str(state), "--edge-name", "edge-r1", "--heartbeat-interval", "0.3"]
    OPS_PORTS.setdefault(port, free_port())
    cmd += ["--initial-timeout", "10", "--port", str(port), "--probe-interval", "0.2"]
    cmd += ["--operator-port", str(OPS_PORTS[port])]
    cmd += ["--scrape-interval", "0.2", "--log-level", "warning"]
    cmd += ["--sync-wait", str(LONG_POLL_S)]
    proc = start_process("edge", cmd, log=tmp / f"edge-{port}.log", append=True)
    try:
        wait_http(ops_url(port) + "/healthz", watch=proc)
    except Exception:
        proc.stop()
        raise
    return proc


def healthz(port: int) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(ops_url(port) + "/healthz", timeout=5).json()
    return data


def wait_for(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def chat(port: int) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for p in reversed(started):
        p.stop()


def test_edge_syncs_verifies_persists_and_survives_the_control_plane(
    tmp_path: Path, procs: list[Process]
) -> None:
    engine = spawn_engine(tmp_path, "i-1")
    procs.append(engine.proc)
    wait_http(engine.url + "/health", watch=engine.proc)
    cp = ControlPlane(tmp_path)
    procs.append(cp.proc)
    cp.publish(signed(cp_doc("r1", 1, [instance(engine)])))
    state = tmp_path / "state"
    port = free_port()
    edge = start_synced_edge(tmp_path, cp.url, state, port)
    procs.append(edge)

    h = healthz(port)
    assert h["table_version"] == 1 and h["table_source"] == "control-plane"
    assert chat(port).status_code == 200
    assert (state / "routing-table.json").exists()

    # A new version reaches the waiting long-poll when it is published, not when the poll's
    # 25 s wait runs out (well within it even on a loaded machine).
    t0 = time.monotonic()
    cp.publish(signed(cp_doc("r1", 2, [instance(engine)])))
    wait_for(lambda: healthz(port)["table_version"] == 2, 10)
    applied_s = time.monotonic() - t0
    assert applied_s < 10.0 < LONG_POLL_S, applied_s

    # Tampered (signed, then changed), foreign region, admission off and backwards versions are
    # refused.
    tampered = orjson.loads(signed(cp_doc("r1", 3, [instance(engine)])))
    tampered["instances"][0]["url"] = "http://127.0.0.1:1"
    cp.publish(orjson.dumps(tampered))
    wait_for(lambda: "tampered" in healthz(port)["sync_error"] or _rejections(port) >= 1, 5)
    assert healthz(port)["table_version"] == 2
    cp.publish(signed(cp_doc("r2", 4, [instance(engine)])))
    wait_for(lambda: _rejections(port) >= 2, 5)
    assert healthz(port)["table_version"] == 2
    cp.publish(signed(table_doc("r1", 5, [instance(engine)])))  # tenants: null
    edge_log = tmp_path / f"edge-{port}.log"
    wait_for(lambda: b"no tenant list" in edge_log.read_bytes(), 10)
    assert healthz(port)["table_version"] == 2
    assert chat(port).status_code == 200

    # Heartbeats carry the applied version and per-instance health and load.
    beat = cp.stats()["beats"][-1]
    assert beat["edge"] == "edge-r1" and beat["applied_table_version"] == 2
    assert beat["instances"][0]["id"] == "i-1" and beat["instances"][0]["healthy"] is True
    assert set(beat["instances"][0]) == {
        "id", "healthy", "in_flight", "queued", "kv_cache_usage", "tokens_per_s", "overflow",
    }  # fmt: skip

    # Control plane down, edge restarted: it serves from the persisted table (static stability).
    cp.proc.stop()
    edge.stop()
    port2 = free_port()
    edge2 = start_synced_edge(tmp_path, cp.url, state, port2)
    procs.append(edge2)
    h = healthz(port2)
    assert h["table_version"] == 2 and h["healthy_instances"] == 1
    assert chat(port2).status_code == 200
    # ... and picks the control plane up again when it is back.
    cp2 = ControlPlane(tmp_path, cp.port)
    procs.append(cp2.proc)
    cp2.publish(signed(cp_doc("r1", 6, [instance(engine)])))
    wait_for(lambda: healthz(port2)["table_version"] == 6, 15)


def test_first_start_without_control_plane_or_saved_table_fails_loudly(tmp_path: Path) -> None:
    cred = tmp_path / "cred"
    cred.write_text("fe_secret")
    keys = tmp_path / "table-keys"
    keys.write_text("k1=x")
    fedinfer = str(Path(sys.executable).parent / "fedinfer")
    cmd = [fedinfer, "edge", "--region", "r1", "--control-plane", f"http://127.0.0.1:{free_port()}"]
    cmd += ["--credential-file", str(cred), "--table-keys-file", str(keys)]
    cmd += ["--initial-timeout", "1"]
    cmd += ["--state-dir", str(tmp_path / "s"), "--port", str(free_port())]
    out = subprocess.run(cmd, capture_output=True, timeout=30, check=False)
    assert out.returncode != 0
    assert b"no routing table" in out.stderr and b"none persisted" in out.stderr


def test_table_and_control_plane_flags_are_exclusive(tmp_path: Path) -> None:
    fedinfer = str(Path(sys.executable).parent / "fedinfer")
    cmd = [fedinfer, "edge", "--region", "r1", "--table", "t.json", "--control-plane", "http://x"]
    out = subprocess.run(cmd, capture_output=True, timeout=30, check=False)
    assert out.returncode == 2 and b"not allowed with argument" in out.stderr


def _rejections(port: int) -> float:
    text = httpx.get(ops_url(port) + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("fedinfer_edge_table_rejections_total"):
            return float(line.split()[-1])
    return 0.0
