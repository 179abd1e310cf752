"""Start the processes a benchmark measures: simulated engines, the edge, the Rust peer router."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.harness.procs import ROOT, fedinfer_argv, http_ok
from regions.supervisor import Process, Supervisor, free_port, free_ports, wait_http
from regions.tables.schema import (
    LOCAL_EDGES_SCHEMA_VERSION,
    SCHEMA_VERSION,
    Instance,
    RoutingTable,
    TenantPolicy,
    validate_table,
)

BENCH_VENV = ROOT / ".venv-bench"
SGLANG_INSTALL = f"python3 -m venv {BENCH_VENV} && {BENCH_VENV}/bin/pip install sglang-router"


@dataclass
class Engines:
    #: One simulator process for every engine, or one process per engine (in port order).
    procs: list[Process]
    ports: list[int]
    model: str
    #: Each engine's KV-event publisher (``tcp://127.0.0.1:port``), when they publish.
    kv_events: list[str] | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    @property
    def proc(self) -> Process:
        """The one simulator process (a bench that watches it started the engines in one)."""
        if len(self.procs) != 1:
            raise ValueError(f"{len(self.procs)} simulator processes, not one")
        return self.procs[0]

    def cpu_seconds(self) -> float:
        """CPU time of every simulator process together."""
        return sum(p.cpu_seconds() for p in self.procs)


def start_engines(
    pg: Supervisor,
    *,
    count: int,
    model: str,
    extra: list[str] | None = None,
    cpus: set[int] | None = None,
    name: str = "engines",
    process_each: bool = False,
    kv_events: bool = False,
) -> Engines:
    """``count`` simulated engines on consecutive ports, in one ``engine-sim`` process or, with
    ``process_each``, one process each (``<name>0``, ``<name>1``, ...): the same engines and
    timing model, but a busy engine's event loop no longer delays the others' steps.
    ``kv_events``: each publishes its KV-cache events (ZMQ, vLLM's format) on a port of its own."""
    ports = free_ports(count)
    # Consecutive, like ``ports``: one process publishes engine i's events on the first + i.
    event_ports = free_ports(count) if kv_events else []
    common = ["--model", model, *(extra or [])]

    def events(i: int) -> list[str]:
        if not kv_events:
            return []
        endpoint = f"tcp://[::ffff:127.0.0.1]:{event_ports[i]}"  # loopback only, as vLLM binds
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
        return ["--kv-events-config", json.dumps(config)]

    if process_each:
        procs = [
            pg.start(f"{name}{i}",
                     fedinfer_argv("engine-sim", "--port", str(p), *common, *events(i)),
                     cpus=cpus)
            for i, p in enumerate(ports)
        ]  # fmt: skip
    else:
        argv = fedinfer_argv("engine-sim", "--count", str(count), "--port", str(ports[0]), *common)
        procs = [pg.start(name, [*argv, *events(0)], cpus=cpus)]
    for i, p in enumerate(ports):
        watch = procs[i] if process_each else procs[0]
        wait_http(f"http://127.0.0.1:{p}/health", watch=watch, timeout=60, ready=http_ok)
    endpoints = [f"tcp://127.0.0.1:{p}" for p in event_ports] if kv_events else None
    return Engines(procs, ports, model, endpoints)


def write_table(
    path: Path,
    engines: Engines,
    *,
    region: str = "bench",
    accelerator: str = "unknown",
    tp: int = 1,
    prefill_tokens_per_s: float = 8000.0,
    max_concurrency: int = 64,
    tenants: tuple[TenantPolicy, ...] | None = None,
    local_edges: int = 1,
) -> Path:
    """A table of ``engines``; with ``tenants`` the edges admit by API key, and
    ``local_edges`` edges share the tenants' rate limits."""
    table = RoutingTable(
        schema_version=LOCAL_EDGES_SCHEMA_VERSION if local_edges > 1 else SCHEMA_VERSION,
        tenants=tenants,
        local_edges=local_edges,
        version=1,
        region=region,
        generated_at=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        instances=tuple(
            Instance(
                id=f"e{i}",
                url=url,
                model=engines.model,
                accelerator=accelerator,
                tp=tp,
                max_concurrency=max_concurrency,
                prefill_tokens_per_s=prefill_tokens_per_s,
                kv_events_endpoint=engines.kv_events[i] if engines.kv_events else None,
            )
            for i, url in enumerate(engines.urls)
        ),
    )
    validate_table(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(table))
    return path


def start_edge(
    pg: Supervisor,
    table: Path,
    *,
    policy: str | None = None,
    cpus: set[int] | None = None,
    region: str = "bench",
    name: str = "edge",
    model: str | None = None,
    extra: Sequence[str] = (),
    admits: bool = False,
    workers: int = 1,
) -> tuple[Process, str, str]:
    """(process, public URL, operator URL: /healthz and /metrics). ``admits``: the table has
    tenants, so the edge is ready when it refuses a request without a key (401). ``workers``:
    its worker processes (the operator URL is worker 0's, :func:`worker_ops` lists them all)."""
    port, ops_port = free_port(), free_ports(workers)[0]
    argv = fedinfer_argv("edge", "--region", region, "--table", str(table), "--port", str(port))
    argv += ["--operator-port", str(ops_port), *extra]
    if workers > 1:
        argv += ["--workers", str(workers)]
    if policy:
        argv += ["--policy", policy]
    proc = pg.start(name, argv, cpus=cpus)
    url = f"http://127.0.0.1:{port}"
    ready = (lambda status: status == 401) if admits else http_ok
    wait_http(f"{url}/v1/models", watch=proc, timeout=60, ready=ready)
    for ops in worker_ops(f"http://127.0.0.1:{ops_port}", workers):
        wait_http(f"{ops}/healthz", watch=proc, timeout=60)
    return proc, url, f"http://127.0.0.1:{ops_port}"


def worker_ops(ops: str, workers: int) -> list[str]:
    """The operator URLs of an edge's workers, from worker 0's (each on the next port)."""
    base, _, port = ops.rpartition(":")
    return [f"{base}:{int(port) + k}" for k in range(workers)]


def tree_cpu_seconds(proc: Process) -> float:
    """CPU seconds of a process and its live children (an edge's workers), from /proc."""
    total = proc.cpu_seconds()
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        return total
    for child in children:
        try:
            stat = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in stat[11:13]) / os.sysconf("SC_CLK_TCK")
    return total


def sglang_available() -> str | None:
    """None when the Rust router can run, else the reason it cannot."""
    py = BENCH_VENV / "bin" / "python"
    if not py.exists():
        return f"{py} missing; install with: {SGLANG_INSTALL}"
    try:
        import subprocess

        out = subprocess.run(
            [str(py), "-c", "import sglang_router.launch_router"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {py}: {exc}"
    if out.returncode != 0:
        return f"sglang_router does not import: {out.stderr.strip()[-300:]}"
    return None


def start_sglang(
    pg: Supervisor, worker_urls: list[str], *, cpus: set[int] | None = None
) -> tuple[Process, str]:
    """The Rust peer router (sglang-router, its own venv) in front of the same engines."""
    port, prom = free_port(), free_port()
    argv = [
        str(BENCH_VENV / "bin" / "python"), "-m", "sglang_router.launch_router",
        "--worker-urls", *worker_urls,
        "--policy", "round_robin",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
        "--log-level", "warn",
    ]  # fmt: skip
    proc = pg.start("sglang-router", argv, cpus=cpus)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", watch=proc, timeout=60, ready=http_ok)
    return proc, url


def which_wrk() -> str | None:
    """The ``wrk`` binary, or None: the overhead benchmarks need it and say so."""
    return shutil.which("wrk")
