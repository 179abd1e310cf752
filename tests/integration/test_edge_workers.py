"""``fedinfer edge --workers 2``: two edge processes on one port, one view (real processes on
loopback, file mode, peer sync over a Redis of the test's own)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from regions.supervisor import Process, free_port, free_ports, start_process, wait_http, wait_until
from tests.integration.redis_support import PrivateRedis
from tests.integration.test_edge_many_edges import chat
from tests.integration.test_edge_support import Engine, instance, route_of, spawn_engine, table_doc

WORKERS = 2
LIMIT_RPS = 4.0
BURST_S = 2.0


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Workers:
    port: int
    ops_ports: list[int]
    proc: Process
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ops(self, worker: int) -> str:
        return f"http://127.0.0.1:{self.ops_ports[worker]}"

    def pids(self) -> list[int]:
        """The worker processes (the parent's children)."""
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False
        )
        return sorted(int(p) for p in out.stdout.split())


#: The edge's peer-sync key ring, in its environment: every worker shares the parent's.
PEER_KEYS_ENV = {**os.environ, "FEDINFER_PEER_KEYS": "w1=workers-peer-secret"}


def start_workers(
    tmp: Path, table: dict[str, Any], *args: str, on: tuple[int, list[int]] | None = None
) -> Workers:
    """``on``: the public and operator ports to use (free ones when absent)."""
    path = tmp / "table.json"
    path.write_text(json.dumps(table))
    port, ops = on if on is not None else (free_port(), free_ports(WORKERS))
    log = tmp / "edge.log"
    fedinfer = str(Path(sys.executable).parent / "fedinfer")
    cmd = [fedinfer, "edge", "--region", table["region"], "--table", str(path)]
    cmd += ["--port", str(port), "--operator-port", str(ops[0]), "--workers", str(WORKERS)]
    cmd += ["--probe-interval", "0.2", "--scrape-interval", "0.2", "--table-poll", "0.2"]
    cmd += ["--log-level", "info", *args]
    proc = start_process("edge-workers", cmd, log=log, env=PEER_KEYS_ENV)
    edge = Workers(port, ops, proc, log)
    try:
        for worker in range(WORKERS):
            wait_http(edge.ops(worker) + "/healthz", watch=proc)
    except Exception:
        proc.stop()
        raise
    return edge


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """Three engines behind one edge of two workers; the table counts one edge (``local_edges``
    1): the workers share the rate limit all the same."""
    tmp = tmp_path_factory.mktemp("edge-workers")
    redis = PrivateRedis(tmp)
    redis.start()
    engines: list[Engine] = []
    workers: Workers | None = None
    try:
        engines = [spawn_engine(tmp, f"i-{k}") for k in range(1, 4)]
        for e in engines:
            wait_http(e.url + "/health", watch=e.proc)
        doc: dict[str, Any] = table_doc("r1", 1, [instance(e) for e in engines])
        doc["tenants"] = [
            {"tenant": "free", "key_hashes": [h("fi_free")], "allowed_regions": ["r1"]},
            {"tenant": "capped", "key_hashes": [h("fi_capped")], "allowed_regions": ["r1"],
             "requests_per_s": LIMIT_RPS},
        ]  # fmt: skip
        workers = start_workers(
            tmp, doc, "--peer-redis-url", redis.url, "--rate-burst", str(BURST_S)
        )
        # Both workers hear each other (peer sync), and have probed every instance.
        for worker in range(WORKERS):
            wait_until(
                lambda w=worker: metric(workers, w, "fedinfer_edge_peers") == WORKERS - 1,
                what=f"worker {worker} hearing the other",
                timeout=10,
            )
        yield workers
    finally:
        if workers is not None:
            workers.proc.stop()
        for e in engines:
            e.proc.stop()
        redis.stop()


def metric(edge: Workers, worker: int, name: str, **labels: str) -> float:
    """Sum of a family's samples at one worker (``name`` without the _total suffix)."""
    text = httpx.get(edge.ops(worker) + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        family = sample.split("{", 1)[0]
        if family not in (name, name + "_total"):
            continue
        if all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total += float(value)
    return total


def served(edge: Workers, worker: int) -> float:
    return metric(edge, worker, "fedinfer_edge_requests")


def test_each_worker_answers_on_its_own_operator_port(edge: Workers) -> None:
    for worker in range(WORKERS):
        health = httpx.get(edge.ops(worker) + "/healthz", timeout=5).json()
        assert (health["worker"], health["workers"]) == (worker, WORKERS)


def test_the_port_spreads_connections_over_the_workers(edge: Workers) -> None:
    before = [served(edge, w) for w in range(WORKERS)]
    statuses = [chat(edge.url, "fi_free", text=f"question {n}").status_code for n in range(40)]
    assert statuses == [200] * 40
    gained = [served(edge, w) - before[w] for w in range(WORKERS)]
    assert sum(gained) == 40
    assert min(gained) >= 5, gained  # both serve (each connection lands by the kernel's hash)


def test_a_session_meets_the_same_instance_at_every_worker(edge: Workers) -> None:
    placed: dict[str, set[str]] = {}
    for turn in range(4):
        for n in range(12):
            session = f"chat-{n}"
            r = chat(edge.url, "fi_free", session, text=f"turn {turn} of {session}")
            assert r.status_code == 200, r.text
            placed.setdefault(session, set()).add(route_of(r.headers)["instance"])
    assert all(len(where) == 1 for where in placed.values()), placed


def test_a_rate_limit_holds_across_the_workers(edge: Workers) -> None:
    """One tenant at 4x its limit, each request on a new connection: the edge admits its limit
    over the span plus one burst, although the table counts one edge and there are two
    processes."""
    statuses: list[int] = []
    period = 1.0 / (4 * LIMIT_RPS)
    start = time.monotonic()
    k = 0
    while (due := start + k * period) < start + 3.0:
        time.sleep(max(0.0, due - time.monotonic()))
        statuses.append(chat(edge.url, "fi_capped").status_code)
        k += 1
    span = time.monotonic() - start
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}
    bound = LIMIT_RPS * span + LIMIT_RPS * BURST_S
    assert admitted <= bound + WORKERS, (admitted, bound)
    assert admitted >= LIMIT_RPS * 3.0, (admitted, bound)


def test_a_killed_worker_is_replaced_and_the_port_keeps_serving(edge: Workers) -> None:
    pids = edge.pids()
    assert len(pids) == WORKERS, pids
    victim = pids[-1]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: victim not in edge.pids(), what="the worker gone", timeout=5)
    # The kernel no longer hands new connections to the dead worker's socket.
    statuses = [chat(edge.url, "fi_free", text=f"after {n}").status_code for n in range(20)]
    assert statuses == [200] * 20
    # The parent starts it again (after 1 s), on the same operator port.
    wait_until(
        lambda: len(edge.pids()) == WORKERS and victim not in edge.pids(),
        what="the worker restarted",
        timeout=10,
    )
    for worker in range(WORKERS):
        wait_http(edge.ops(worker) + "/healthz", watch=edge.proc)
    assert "restarting it in 1 s" in edge.log.read_text()
    assert [chat(edge.url, "fi_free").status_code for _ in range(10)] == [200] * 10


def test_sigterm_stops_every_worker_and_the_edge_exits_cleanly(tmp_path: Path) -> None:
    redis = PrivateRedis(tmp_path)
    redis.start()
    engine = spawn_engine(tmp_path, "solo")
    try:
        wait_http(engine.url + "/health", watch=engine.proc)
        workers = start_workers(
            tmp_path, table_doc("r9", 1, [instance(engine)]), "--peer-redis-url", redis.url
        )
        pids = workers.pids()
        assert len(pids) == WORKERS
        assert chat(workers.url, "none").status_code == 200
        workers.proc.send_signal(signal.SIGTERM)
        assert workers.proc.wait(timeout=20) == 0
        assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
        assert "edge stopping its 2 workers (SIGTERM)" in workers.log.read_text()
    finally:
        engine.proc.stop()
        redis.stop()


def time_wait_on(port: int) -> int:
    """Connections in TIME_WAIT whose local end is ``127.0.0.1:port`` (the server's side)."""
    out = subprocess.run(
        ["ss", "-tanH", "state", "time-wait", "src", f"127.0.0.1:{port}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return len(out.stdout.splitlines())


def serve_and_stop(url: str, proc: Process) -> None:
    """Traffic the edge closes first, then a stop: requests with ``connection: close``, and
    keep-alive connections still open when it stops (closed by the edge, then by the client)."""
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": "Bearer none", "connection": "close"}
    for _ in range(10):
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
        assert r.status_code == 200, r.text
    kept = [httpx.Client(base_url=url, timeout=10) for _ in range(4)]
    for client in kept:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    for client in kept:
        client.close()


def test_the_edge_restarts_on_its_port_at_once_after_serving_traffic(tmp_path: Path) -> None:
    """The connections an edge closed leave TIME_WAIT sockets on its port for a minute. A
    multi-worker edge binds the port all the same, at once, whatever left them: an edge of one
    process before it (asyncio's listener, no ``SO_REUSEPORT``: the case that failed with
    ``Address already in use``), or its own workers."""
    redis = PrivateRedis(tmp_path)
    redis.start()
    engine = spawn_engine(tmp_path, "solo")
    running: Process | None = None
    try:
        wait_http(engine.url + "/health", watch=engine.proc)
        table = table_doc("r6", 1, [instance(engine)])
        (tmp_path / "table.json").write_text(json.dumps(table))
        port, ops = free_port(), free_ports(WORKERS)
        fedinfer = str(Path(sys.executable).parent / "fedinfer")
        single = [fedinfer, "edge", "--region", "r6", "--table", str(tmp_path / "table.json")]
        single += ["--port", str(port), "--operator-port", str(ops[0])]
        running = start_process("edge-single", single, log=tmp_path / "single.log")
        wait_http(f"http://127.0.0.1:{ops[0]}/healthz", watch=running)
        serve_and_stop(f"http://127.0.0.1:{port}", running)
        running = None
        for _ in range(2):  # after the single edge, then after its own workers
            assert time_wait_on(port) > 0, "no TIME_WAIT on the port: nothing is tested"
            workers = start_workers(tmp_path, table, "--peer-redis-url", redis.url, on=(port, ops))
            running = workers.proc
            assert chat(workers.url, "none").status_code == 200
            serve_and_stop(workers.url, workers.proc)
            running = None
    finally:
        if running is not None:
            running.stop()
        engine.proc.stop()
        redis.stop()


def test_a_worker_that_cannot_start_stops_the_edge(tmp_path: Path) -> None:
    """A bad table: each worker fails before it serves, and the edge exits 1 saying why."""
    bad = table_doc("r8", 1, [])
    bad["schema_version"] = 99
    path = tmp_path / "table.json"
    path.write_text(json.dumps(bad))
    fedinfer = str(Path(sys.executable).parent / "fedinfer")
    cmd = [fedinfer, "edge", "--region", "r8", "--table", str(path), "--workers", "2"]
    cmd += ["--port", str(free_port()), "--peer-redis-url", "redis://127.0.0.1:1/0"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=30, check=False, env=PEER_KEYS_ENV
    )
    assert done.returncode == 1, done
    assert "before it served: stopping the edge" in done.stderr
    assert "schema_version" in done.stderr


def test_several_workers_need_a_peer_redis(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table_doc("r7", 1, [])))
    fedinfer = str(Path(sys.executable).parent / "fedinfer")
    cmd = [fedinfer, "edge", "--region", "r7", "--table", str(path), "--workers", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode != 0
    assert "--workers above 1 needs --peer-redis-url" in done.stderr
