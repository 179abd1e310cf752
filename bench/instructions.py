"""Metering's price at the edge in instructions per request, counted by callgrind.

``bench.overhead`` measures metering as the metered edge's CPU per request minus the plain
edge's, in the same repetition. On this 2-core machine that difference (a few µs out of 150-500)
is smaller than the noise between repetitions (±10 µs), so one run meets the 5 µs target and the
next misses it. Instructions retired do not depend on what else the machine runs: this bench
runs both edges under valgrind's callgrind, counts the instructions each spends on exactly N
requests, and reports the difference per request.

Per edge (plain, then metered: spool and shipment to the bench's own Redis, as in
``bench.overhead``): start under callgrind with instrumentation off, warm up (imports, caches,
the shipper's first batches), then for each phase zero the counters, switch instrumentation on,
run the phase, dump, switch it off:

* ``idle``: no requests for as long as the load phase lasted — timers, heartbeats and the
  shipper's polling, which run by time, not by request;
* ``plain`` / ``stream``: N requests (non-streamed / streamed chat completions, 16 tokens), C at
  a time, every one answered before the dump.

Instructions per request = (load phase - idle phase scaled to the same wall time) ÷ N.
Per-batch work (one spool write and fsync, one ``XADD``, the acknowledgement) is shared by the
records a batch carries, and under valgrind the edge serves ~50x fewer requests per second: at
the default 50 ms a batch would carry a few records instead of the hundreds it carries at full
speed. So the metered edge runs with ``--usage-flush-interval`` stretched by the plain edge's
measured slowdown (native requests/s at 64 connections over its requests/s under callgrind),
and the records per shipment actually seen are reported. Kernel time (the syscalls themselves)
is not counted by callgrind; it is per batch, not per request.

To turn the difference into µs the bench measures the plain edge natively in the same run
(``wrk`` at 64 connections, median of ``--native-reps`` runs of its CPU per request, as in
``bench.overhead``) and charges metering its share of the plain edge's instructions. Callgrind
counts user-space instructions only, so the share is of the edge's *user* CPU time:
µs = ΔIr ÷ Ir(plain) * user CPU µs(plain). (A proxy spends a large part of its CPU in the kernel,
on its sockets; metering's kernel work is per batch. The share of all of the edge's CPU, user
and system, is reported too, as an upper bound.)

    .venv/bin/python -m bench instructions [--requests 2000] [--concurrency 8]

``--continuation`` counts instead what keeping a stream continuable costs (``docs/continuation.md``:
each chunk relayed is remembered, each stream is registered for drain migration): the plain edge
with ``--max-continuations 0 --drain-migrate-after never`` against the plain edge as it ships,
on streams of ``--tokens`` tokens, priced per token as above.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis

from bench.harness.fleet import Engines, start_engines, which_wrk, write_table
from bench.harness.procs import PYTHON, VAR, bench_processes, git_rev, http_ok, machine_info
from bench.harness.report import fmt, markdown_table, utc_now, write_result
from bench.overhead import (
    ENGINE_CPUS,
    MODEL,
    ROUTER_CPUS,
    TARGETS,
    request_body,
    run_wrk,
    start_redis,
)
from regions.edge.metering.usage_shipper import FLUSH_INTERVAL_S as DEFAULT_FLUSH_S
from regions.supervisor import Process, Supervisor, free_port, wait_http
from regions.tables.usage import USAGE_FIELD, USAGE_STREAM

#: Periodic work (engine probes and scrapes, table-file checks) runs by wall time, and under
#: valgrind a request takes ~50x longer: left on, it would be half of what is counted per
#: request. Both edges run with it slowed to once an hour; the idle phase removes the rest.
QUIET = ["--table-poll", "3600", "--probe-interval", "3600", "--scrape-interval", "3600"]
#: Time an edge has to start under valgrind (~20 s here).
VALGRIND_START_S = 300.0
_TOTALS = re.compile(rb"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def start_edge_under_callgrind(
    pg: Supervisor, table: Path, name: str, outdir: Path, extra: list[str]
) -> tuple[Process, str]:
    """An edge run by callgrind with instrumentation off until a phase switches it on."""
    port, ops_port = free_port(), free_port()
    argv = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no",
        f"--callgrind-out-file={outdir}/callgrind.{name}.%p",
        PYTHON, str(Path(PYTHON).parent / "fedinfer"), "edge", "--region", "bench",
        "--table", str(table), "--port", str(port), "--operator-port", str(ops_port),
        *QUIET, *extra,
    ]  # fmt: skip
    proc = pg.start(name, argv, cpus=ROUTER_CPUS)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/v1/models", watch=proc, timeout=VALGRIND_START_S, ready=http_ok)
    return proc, url


async def _send(url: str, body: bytes, stream: bool, count: int, concurrency: int) -> None:
    """Exactly ``count`` requests, ``concurrency`` at a time, each read to its end."""
    todo = iter(range(count))
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def worker() -> None:
            for _ in todo:
                async with client.stream(
                    "POST", "/v1/chat/completions", content=body, headers=headers
                ) as resp:
                    async for _chunk in resp.aiter_raw():
                        pass
                    if resp.status_code != 200:
                        raise SystemExit(f"{url}: HTTP {resp.status_code} (stream={stream})")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def _callgrind(action: str, pid: int, *extra: str) -> None:
    subprocess.run(["callgrind_control", action, *extra, str(pid)], check=True, capture_output=True)


def _phase(proc: Process, outdir: Path, label: str, work: Any) -> tuple[int, float]:
    """(instructions, wall seconds) of the edge while ``work()`` runs."""
    before = set(outdir.glob(f"callgrind.*.{proc.pid}*"))
    _callgrind("--zero", proc.pid)
    _callgrind("--instr=on", proc.pid)
    started = time.monotonic()
    work()
    wall = time.monotonic() - started
    _callgrind(f"--dump={label}", proc.pid)
    _callgrind("--instr=off", proc.pid)
    dumps = set(outdir.glob(f"callgrind.*.{proc.pid}*")) - before
    total = 0
    for dump in dumps:
        match = _TOTALS.search(dump.read_bytes())
        if match is None:
            raise SystemExit(f"no totals in {dump}")
        total += int(match.group(1))
    if not dumps:
        raise SystemExit(f"callgrind wrote no dump for {label} (pid {proc.pid})")
    return total, wall


def measure_edge(
    proc: Process,
    url: str,
    outdir: Path,
    bodies: dict[bool, bytes],
    requests: int,
    conc: int,
    settle_s: float,
) -> dict[str, Any]:
    """Instructions per request of one edge, non-streamed and streamed, background removed.
    Each load phase lasts ``settle_s`` past its last answer, so the batch holding the last
    records is written and shipped inside it."""

    def load(stream: bool) -> Any:
        def work() -> None:
            asyncio.run(_send(url, bodies[stream], stream, requests, conc))
            time.sleep(settle_s)

        return work

    for stream in (False, True):  # warm-up: not counted
        asyncio.run(_send(url, bodies[stream], stream, max(requests // 4, 50), conc))
    # ... and past a flush interval, so the shipper's first batch (its thread pool, its Redis
    # connection, the spool's first segment) is not counted in the first phase.
    time.sleep(settle_s)
    out: dict[str, Any] = {}
    for stream, label in ((False, "plain"), (True, "stream")):
        instr, wall = _phase(proc, outdir, label, load(stream))
        idle, idle_wall = _phase(proc, outdir, f"idle-{label}", lambda w=wall: time.sleep(w))
        background = idle * wall / idle_wall
        out[label] = {
            "instructions": instr,
            "wall_s": round(wall, 2),
            "idle_instructions": idle,
            "idle_wall_s": round(idle_wall, 2),
            "per_request": (instr - background) / requests,
        }
        print(
            f"{proc.name:13s} {label:6s} {out[label]['per_request'] / 1e6:8.3f} M instr/request"
            f"  (load {instr / 1e6:,.0f} M in {wall:.1f} s, idle {idle / 1e6:,.0f} M"
            f" in {idle_wall:.1f} s)",
            flush=True,
        )
    return out


def native_cpu_us(
    pg: Supervisor, table: Path, engine: Process, body: Path, reps: int
) -> tuple[float, float, float]:
    """The plain edge natively, wrk at 64 connections: (CPU µs per request, of which user
    space, requests/s), medians of ``reps`` runs."""
    from bench.harness.fleet import start_edge

    proc, url, _ = start_edge(pg, table, cpus=ROUTER_CPUS, name="edge-native")
    watch = {"engine": engine, "router": proc}
    run_wrk(url, body, 64, 2.0, watch)  # warm-up
    per_req, user_per_req, rps = [], [], []
    for _ in range(reps):
        user0 = _user_seconds(proc.pid)
        res = run_wrk(url, body, 64, 4.0, watch)
        user = _user_seconds(proc.pid) - user0
        per_req.append(res["cpu_share"]["router"] / res["rps"] * 1e6)
        user_per_req.append(user / res["requests"] * 1e6)
        rps.append(res["rps"])
    pg.stop(proc)
    return statistics.median(per_req), statistics.median(user_per_req), statistics.median(rps)


def _user_seconds(pid: int) -> float:
    """User CPU time of a process (``/proc/<pid>/stat`` utime)."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(stat[11]) / os.sysconf("SC_CLK_TCK")


def records_per_shipment(redis_url: str) -> float:
    """Mean records per entry of the usage stream (one entry per shipped batch)."""
    client = redis.Redis.from_url(redis_url)
    entries = client.xrange(USAGE_STREAM)
    records = sum(len(fields[USAGE_FIELD].splitlines()) for _, fields in entries)
    return records / max(len(entries), 1)


def run(requests: int = 2000, concurrency: int = 8, native_reps: int = 5) -> dict[str, Any]:
    """Both edges under callgrind, then natively: the instruction counts and their price in µs."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    if which_wrk() is None:
        raise SystemExit("wrk not found: apt-get install wrk")
    started, machine_before = utc_now(), machine_info()
    tmp = Path(tempfile.mkdtemp(prefix="bench-instructions-"))
    bodies = {s: request_body(s) for s in (False, True)}
    wrk_body = tmp / "body.json"
    wrk_body.write_bytes(bodies[False])
    edges: dict[str, Any] = {}
    with bench_processes(VAR / "logs" / "instructions") as pg:
        engines, table = _zero_latency_engine(pg, tmp)
        redis_url = start_redis(pg, cpus=ENGINE_CPUS)
        native, native_user, native_rps = native_cpu_us(
            pg, table, engines.proc, wrk_body, native_reps
        )
        print(
            f"plain edge natively: {native:.1f} µs CPU per request ({native_user:.1f} µs user),"
            f" {native_rps:.0f} req/s (wrk -c64)",
            flush=True,
        )
        proc, url = start_edge_under_callgrind(pg, table, "edge", tmp, [])
        edges["edge"] = measure_edge(proc, url, tmp, bodies, requests, concurrency, 0.0)
        pg.stop(proc)
        slowdown = native_rps / (requests / edges["edge"]["plain"]["wall_s"])
        flush_s = round(min(60.0, DEFAULT_FLUSH_S * slowdown), 3)
        metered = ["--usage-spool-dir", str(tmp / "spool"), "--usage-redis-url", redis_url]
        metered += ["--usage-flush-interval", str(flush_s)]
        credential = tmp / "edge-metered.credential"  # signs its stream entries
        credential.write_text("bench-edge-credential")
        metered += ["--edge-name", "edge-metered", "--credential-file", str(credential)]
        proc, url = start_edge_under_callgrind(pg, table, "edge-metered", tmp, metered)
        edges["edge-metered"] = measure_edge(
            proc, url, tmp, bodies, requests, concurrency, flush_s * 1.5
        )
        pg.stop(proc)
        shipment = records_per_shipment(redis_url)
    summary: dict[str, Any] = {
        "native_edge_cpu_us_per_req": round(native, 1),
        "native_edge_user_cpu_us_per_req": round(native_user, 1),
        "native_edge_rps_c64": round(native_rps),
        "callgrind_slowdown": round(slowdown, 1),
        "metered_flush_interval_s": flush_s,
        "records_per_shipment": round(shipment, 1),
        "records_per_shipment_native": round(native_rps * DEFAULT_FLUSH_S, 1),
    }
    for label in ("plain", "stream"):
        base = edges["edge"][label]["per_request"]
        added = edges["edge-metered"][label]["per_request"] - base
        summary[label] = {
            "edge_instructions_per_req": round(base),
            "metered_instructions_per_req": round(base + added),
            "added_instructions_per_req": round(added),
            "added_share": round(added / base, 4),
            "added_cpu_us_per_req": round(added / base * native_user, 2),
            "added_cpu_us_per_req_upper": round(added / base * native, 2),
        }
    result = _result(
        started,
        machine_before,
        {"requests": requests, "concurrency": concurrency, "native_reps": native_reps},
        edges,
        summary,
    )
    result["target_metering_cpu_us_per_req"] = TARGETS["metering_cpu_us_per_req_c64"]
    path = write_result("instructions", result)
    print(render(result))
    print(f"\nresults: {path}")
    return result


def _zero_latency_engine(pg: Supervisor, tmp: Path) -> tuple[Engines, Path]:
    """The one engine both edges front (zero latency: only the edge's work is counted), and
    its table."""
    engines = start_engines(
        pg, count=1, model=MODEL, extra=["--zero-latency", "--seed", "1"], cpus=ENGINE_CPUS
    )
    return engines, write_table(tmp / "table.json", engines, max_concurrency=4096)


def _result(
    started: str,
    machine_before: dict[str, Any],
    params: dict[str, Any],
    edges: dict[str, Any],
    summary: dict[str, Any],
) -> dict[str, Any]:
    """A run's JSON document: what ran, where, on what, and what it counted."""
    return {
        "benchmark": "instructions",
        "started": started,
        "finished": utc_now(),
        "git": git_rev(),
        "command": "python -m bench instructions " + " ".join(sys.argv[1:]),
        "machine_before": machine_before,
        "machine_after": machine_info(),
        "params": params,
        "edges": edges,
        "summary": summary,
    }


def render(result: dict[str, Any]) -> str:
    """The result as the Markdown table of docs/benchmarks.md."""
    s = result["summary"]
    target = result["target_metering_cpu_us_per_req"]
    rows = [
        [
            label,
            fmt(s[label]["edge_instructions_per_req"] / 1e3, 1),
            fmt(s[label]["metered_instructions_per_req"] / 1e3, 1),
            f"{fmt(s[label]['added_instructions_per_req'] / 1e3, 1)}"
            f" ({s[label]['added_share'] * 100:.1f} %)",
            f"{fmt(s[label]['added_cpu_us_per_req'], 2)}"
            + (" met" if s[label]["added_cpu_us_per_req"] <= target else " MISSED"),
            fmt(s[label]["added_cpu_us_per_req_upper"], 2),
        ]
        for label in ("plain", "stream")
    ]
    head = ["requests", "edge k instr/req", "metered k instr/req", "added", "added µs (≤ 5)"]
    head += ["upper bound µs (share of user + system)"]
    return (
        f"git {result['git']}: plain edge natively {s['native_edge_cpu_us_per_req']} µs CPU"
        f" ({s['native_edge_user_cpu_us_per_req']} µs user) and "
        f"{s['native_edge_rps_c64']} req/s at c64; under callgrind {s['callgrind_slowdown']}x "
        f"slower, so the metered edge flushed every {s['metered_flush_interval_s']} s: "
        f"{s['records_per_shipment']} records per shipment (natively at c64: "
        f"{s['records_per_shipment_native']})\n\n" + markdown_table(head, rows)
    )


#: The edge with nothing kept for continuation, the baseline of ``--continuation``.
NO_CONTINUATION = ["--max-continuations", "0", "--drain-migrate-after", "never"]


def run_continuation(requests: int, concurrency: int, tokens: int) -> dict[str, Any]:
    """The price of continuation's bookkeeping per streamed token, in instructions and µs."""
    if shutil.which("valgrind") is None or which_wrk() is None:
        raise SystemExit("valgrind and wrk are needed: apt-get install valgrind wrk")
    started, machine_before = utc_now(), machine_info()
    tmp = Path(tempfile.mkdtemp(prefix="bench-continuation-"))
    long_stream = orjson.loads(request_body(True))
    long_stream.update(max_tokens=tokens, ignore_eos=True)
    bodies = {False: request_body(False), True: orjson.dumps(long_stream)}
    wrk_body = tmp / "body.json"
    wrk_body.write_bytes(bodies[False])
    edges: dict[str, Any] = {}
    with bench_processes(VAR / "logs" / "instructions") as pg:
        engines, table = _zero_latency_engine(pg, tmp)
        _, native_user, _ = native_cpu_us(pg, table, engines.proc, wrk_body, 3)
        for name, extra in (("edge-no-continuation", NO_CONTINUATION), ("edge", [])):
            proc, url = start_edge_under_callgrind(pg, table, name, tmp, extra)
            edges[name] = measure_edge(proc, url, tmp, bodies, requests, concurrency, 0.0)
            pg.stop(proc)
    base = edges["edge-no-continuation"]
    added = edges["edge"]["stream"]["per_request"] - base["stream"]["per_request"]
    us_per_instruction = native_user / base["plain"]["per_request"]
    summary = {
        "tokens_per_stream": tokens,
        "stream_instructions_per_req": round(base["stream"]["per_request"]),
        "added_instructions_per_stream": round(added),
        "added_instructions_per_token": round(added / tokens, 1),
        "added_share": round(added / base["stream"]["per_request"], 4),
        "added_cpu_us_per_token": round(added / tokens * us_per_instruction, 3),
        "native_edge_user_cpu_us_per_req": round(native_user, 1),
    }
    params = {"requests": requests, "concurrency": concurrency, "tokens": tokens}
    result = _result(started, machine_before, params, edges, summary)
    path = write_result("instructions-continuation", result)
    print(
        f"git {result['git']}: streams of {tokens} tokens, "
        f"{summary['stream_instructions_per_req'] / 1e3:.1f} k instructions each without "
        f"continuation; keeping them continuable adds {summary['added_instructions_per_token']}"
        f" instructions a token ({summary['added_share'] * 100:.2f} %), "
        f"{summary['added_cpu_us_per_token']} µs of CPU a token"
    )
    print(f"\nresults: {path}")
    return result


def main(argv: list[str] | None = None) -> None:
    """Count both edges; print the table and write the JSON under var/bench/."""
    ap = argparse.ArgumentParser(
        prog="python -m bench instructions",
        description="metering's instructions per request at the edge, counted by callgrind",
    )
    ap.add_argument("--requests", type=int, default=2000, help="requests per phase (2000)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (8)")
    ap.add_argument("--native-reps", type=int, default=5, help="native wrk runs (5)")
    ap.add_argument(
        "--continuation",
        action="store_true",
        help="count what keeping streams continuable costs a token, instead of metering",
    )
    ap.add_argument("--tokens", type=int, default=128, help="tokens a stream (--continuation)")
    args = ap.parse_args(argv)
    if args.continuation:
        run_continuation(args.requests, args.concurrency, args.tokens)
    else:
        run(args.requests, args.concurrency, args.native_reps)


if __name__ == "__main__":
    main()
