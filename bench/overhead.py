"""Overhead of a routing hop: one zero-latency engine direct, via the edge, via a Rust router.

All three paths are measured in ONE run, interleaved (direct, edge, rust; the order rotates per
repetition) so that drift and noise from other work on the machine hit all of them alike. The
load generator is ``wrk`` (C, epoll, one thread) with a Lua POST script, not Python: on a 2-core
machine a Python client would be the bottleneck. Pinning: the router under test (edge or
sglang-router) alone on CPU 0; the engine and wrk on CPU 1. Both routers get exactly one core
(the edge is one uvicorn process; tokio sizes its pool from the affinity mask).

Measured per (path, stream, concurrency): requests/s and latency percentiles from wrk (μs
resolution), plus the CPU share of engine and router. Added latency = router - direct in the
same repetition; the median over repetitions is reported, with min..max as the noise.

A fourth path, ``edge-metered``, is the same edge with usage metering on (a record per request,
spooled and shipped to a Redis usage stream): metering's price is its CPU per request minus the
plain edge's, in the same repetition. The Redis it ships to is the bench's own ``redis-server``,
pinned with the engine and wrk, as a production edge's Redis runs on another machine: the
machine's shared Redis would be scheduled on the router's core and charge its work to the edge
(``--usage-redis-url`` ships to a given Redis instead, its stream deleted after).

With ``--tracing``, a fifth path, ``edge-traced``, is the same edge with OpenTelemetry tracing on
(every request traced, exported over OTLP/HTTP to a sink on the engine's CPU that reads and
drops the batches): tracing's price is its CPU per request and added latency minus the plain
edge's. The plain ``edge`` path is the default edge, tracing off.

    .venv/bin/python -m bench.overhead [--reps 3] [--duration 4] [--tracing]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import redis

from bench.harness.fleet import (
    SGLANG_INSTALL,
    sglang_available,
    start_edge,
    start_engines,
    start_sglang,
    which_wrk,
    write_table,
)
from bench.harness.otlp_sink import sink_stats, start_otlp_sink
from bench.harness.procs import VAR, bench_processes, git_rev, machine_info
from bench.harness.report import fmt, markdown_table, spread, utc_now, write_result
from regions.supervisor import Process, Supervisor, free_port
from regions.tables.usage import USAGE_STREAM

LUA = Path(__file__).with_name("wrk_post.lua")
MODEL = "bench-zero"
ROUTER_CPUS = {0}
ENGINE_CPUS = {1}
CLIENT_CPUS = {1}
PACED_MS = 64.0
#: ``--usage-redis-url`` value that starts the bench's own Redis (see the module docstring).
PRIVATE_REDIS = "private"

TARGETS = {
    "added_p50_ms_c1": 1.0,  # edge p50 - direct p50, one request at a time
    "added_p99_ms_c64": 5.0,  # edge p99 - direct p99, 64 concurrent
    "rps_ratio_vs_rust_c64": 0.8,  # edge requests/s ÷ Rust router requests/s, 64 concurrent
    "metering_cpu_us_per_req_c64": 5.0,  # metered edge - edge, µs of CPU per request
}


def start_redis(pg: Supervisor, *, cpus: set[int]) -> str:
    """A throwaway ``redis-server`` (no persistence) pinned to ``cpus``; its URL."""
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server not found: apt-get install redis-server")
    port = free_port()
    argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = pg.start("redis", argv, cpus=cpus)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"the bench's redis-server did not start: {pg.output('redis')}"
                ) from None
            time.sleep(0.05)


def request_body(stream: bool) -> bytes:
    """The measured request: a small chat completion, streamed or not."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello to the benchmark in a few words."}],
        "max_tokens": 16,
    }
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def run_wrk(
    url: str,
    body_file: Path,
    conns: int,
    duration: float,
    watch: dict[str, Process],
    pace_ms: float = 0.0,
) -> dict[str, Any]:
    """One wrk run; returns its numbers plus CPU shares of the watched processes. With
    ``pace_ms`` each connection pauses ~that long between requests (offered load below
    saturation) instead of sending back to back."""
    argv = [
        "wrk",
        "-t1",
        f"-c{conns}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA),
        f"{url}/v1/chat/completions",
    ]
    env = {**os.environ, "BENCH_BODY_FILE": str(body_file), "BENCH_DELAY_MS": str(pace_ms)}
    cpu0 = {k: p.cpu_seconds() for k, p in watch.items()}
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    out = subprocess.run(
        argv,
        env=env,
        capture_output=True,
        text=True,
        timeout=duration + 60,
        preexec_fn=lambda: os.sched_setaffinity(0, CLIENT_CPUS & os.sched_getaffinity(0) or {0}),
    )
    wall = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu1 = {k: p.cpu_seconds() for k, p in watch.items()}
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCHJSON ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(
            f"wrk failed ({out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}"
        )
    res: dict[str, Any] = json.loads(line.removeprefix("BENCHJSON "))
    res["rps"] = res["requests"] / (res["duration_us"] / 1e6)
    res["cpu_share"] = {k: (cpu1[k] - cpu0[k]) / wall for k in watch}
    res["cpu_share"]["wrk"] = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / wall
    # CPU time per request: robust to other load on the machine, unlike requests/s.
    res["cpu_us_per_req"] = {
        k: v * wall / res["requests"] * 1e6 if res["requests"] else float("nan")
        for k, v in res["cpu_share"].items()
    }
    errs = sum(res["errors"].values())
    res["error_count"] = errs
    return res


def check_path(url: str, stream: bool, expect_route_header: bool) -> None:
    """One request by hand: 200, the right shape, and the edge's route header."""
    import urllib.request

    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=request_body(stream),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
        if expect_route_header and not r.headers.get("x-fedinfer-route"):
            raise RuntimeError(f"{url}: no x-fedinfer-route header")
    if stream:
        if b"data: [DONE]" not in data:
            raise RuntimeError(f"{url}: stream did not end with [DONE]: {data[-200:]!r}")
    elif not orjson.loads(data).get("choices"):
        raise RuntimeError(f"{url}: no choices in {data[:200]!r}")


def run(
    reps: int = 3,
    duration: float = 4.0,
    warmup: float = 2.0,
    usage_redis_url: str = "",
    tracing: bool = False,
) -> dict[str, Any]:
    """Every path, case and repetition, interleaved so drift hits all paths alike."""
    wrk = which_wrk()
    if wrk is None:
        raise SystemExit("wrk not found: apt-get install wrk")
    sglang_reason = sglang_available()
    started = utc_now()
    machine_before = machine_info()
    # (stream, connections, pause per connection in ms): 64 connections pausing ~64 ms offer
    # ~1000 req/s, below every path's ceiling: added latency without saturation queueing.
    cases = [(False, 1, 0.0), (False, 64, 0.0), (False, 64, PACED_MS), (True, 1, 0.0),
             (True, 64, 0.0)]  # fmt: skip
    runs: list[dict[str, Any]] = []
    shipped = 0  # usage batches in the stream at the end
    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    sink_file = tmp / "otlp-sink.json"  # what the traced edge's sink received
    bodies = {s: tmp / f"body-{int(s)}.json" for s in (False, True)}
    for s, p in bodies.items():
        p.write_bytes(request_body(s))

    with bench_processes(VAR / "logs" / "overhead") as pg:
        engines = start_engines(
            pg, count=1, model=MODEL, extra=["--zero-latency", "--seed", "1"], cpus=ENGINE_CPUS
        )
        table = write_table(tmp / "table.json", engines, max_concurrency=4096)
        edge_proc, edge_url, _ = start_edge(pg, table, cpus=ROUTER_CPUS)
        paths: dict[str, tuple[str, Process | None]] = {
            "direct": (engines.urls[0], None),
            "edge": (edge_url, edge_proc),
        }
        if usage_redis_url == PRIVATE_REDIS:
            usage_redis_url = start_redis(pg, cpus=ENGINE_CPUS)
        if usage_redis_url:
            metered = ["--usage-spool-dir", str(tmp / "spool"), "--usage-redis-url"]
            metered.append(usage_redis_url)
            # Stream entries are signed with the edge's credential (nothing ingests them here).
            credential = tmp / "edge-metered.credential"
            credential.write_text("bench-edge-credential")
            metered += ["--edge-name", "edge-metered", "--credential-file", str(credential)]
            proc, url, _ = start_edge(
                pg, table, cpus=ROUTER_CPUS, name="edge-metered", extra=metered
            )
            paths["edge-metered"] = (url, proc)
        if tracing:
            traced = ["--otlp-endpoint", start_otlp_sink(pg, sink_file, cpus=ENGINE_CPUS)]
            proc, url, _ = start_edge(pg, table, cpus=ROUTER_CPUS, name="edge-traced", extra=traced)
            paths["edge-traced"] = (url, proc)
        if sglang_reason is None:
            rust_proc, rust_url = start_sglang(pg, engines.urls, cpus=ROUTER_CPUS)
            paths["rust"] = (rust_url, rust_proc)
        for name, (url, _) in paths.items():
            for stream in (False, True):
                check_path(url, stream, expect_route_header=name.startswith("edge"))
        for url, proc in paths.values():  # warm-up, discarded
            watch = {"engine": engines.proc, **({"router": proc} if proc else {})}
            run_wrk(url, bodies[False], 64, warmup, watch)
            run_wrk(url, bodies[True], 8, warmup / 2, watch)

        names = list(paths)
        for rep in range(reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                url, proc = paths[name]
                watch = {"engine": engines.proc, **({"router": proc} if proc else {})}
                for stream, conns, pace in cases:
                    res = run_wrk(url, bodies[stream], conns, duration, watch, pace)
                    res.update(rep=rep, path=name, stream=stream, conns=conns, paced=pace > 0)
                    runs.append(res)
                    lat = res["latency_us"]
                    cpu = {k: round(v, 2) for k, v in res["cpu_share"].items()}
                    print(
                        f"rep {rep} {name:6s} stream={int(stream)} c={conns:<3d}"
                        f"{' paced' if pace else ''} "
                        f"{res['rps']:8.0f} req/s  p50 {lat['p50'] / 1000:6.2f} ms  "
                        f"p99 {lat['p99'] / 1000:6.2f} ms  errors {res['error_count']}  cpu {cpu}",
                        flush=True,
                    )

        if usage_redis_url:
            usage = redis.Redis.from_url(usage_redis_url)
            shipped = usage.xlen(USAGE_STREAM)
            usage.delete(USAGE_STREAM)
    summary = summarise(runs, list(paths))
    result = {
        "benchmark": "overhead",
        "started": started,
        "finished": utc_now(),
        "git": git_rev(),
        "command": "python -m bench.overhead " + " ".join(sys.argv[1:]),
        "machine_before": machine_before,
        "machine_after": machine_info(),
        "tracing": (
            "edge-traced exports every request's spans to a local OTLP sink "
            f"({sink_stats(sink_file)})"
            if tracing
            else "off"
        ),
        "pinning": {
            "router": sorted(ROUTER_CPUS),
            "engine": sorted(ENGINE_CPUS),
            "wrk": sorted(CLIENT_CPUS),
        },
        "params": {
            "reps": reps,
            "duration_s": duration,
            "warmup_s": warmup,
            "model": MODEL,
            "max_tokens": 16,
        },
        "rust_router": "sglang-router (round_robin)" if sglang_reason is None else sglang_reason,
        "metering": (
            f"edge-metered ships to {usage_redis_url} ({shipped} batches)"
            if usage_redis_url
            else "off"
        ),
        "runs": runs,
        "summary": summary,
    }
    path = write_result("overhead", result)
    print(render(result))
    print(f"\nresults: {path}")
    return result


def summarise(runs: list[dict[str, Any]], paths: list[str]) -> dict[str, Any]:
    """Medians over repetitions, differences paired by repetition, and the targets judged."""

    def get(
        path: str, stream: bool, conns: int, rep: int, paced: bool = False
    ) -> dict[str, Any] | None:
        for r in runs:
            key = (r["path"], r["stream"], r["conns"], r["rep"], r.get("paced", False))
            if key == (path, stream, conns, rep, paced):
                return r
        return None

    reps = sorted({r["rep"] for r in runs})
    out: dict[str, Any] = {"cases": {}, "targets": {}}
    combos = [(False, 1, False), (False, 64, False), (False, 64, True), (True, 1, False),
              (True, 64, False)]  # fmt: skip
    for stream, conns, paced in combos:
        key = f"{'stream' if stream else 'chat'}-c{conns}{'-paced' if paced else ''}"
        case: dict[str, Any] = {}
        for path in paths:
            rs = [get(path, stream, conns, k, paced) for k in reps]
            rs = [r for r in rs if r]
            case[path] = {
                "rps": spread([r["rps"] for r in rs]),
                "p50_ms": spread([r["latency_us"]["p50"] / 1000 for r in rs]),
                "p99_ms": spread([r["latency_us"]["p99"] / 1000 for r in rs]),
                "errors": sum(r["error_count"] for r in rs),
                "cpu_share": {
                    k: spread([r["cpu_share"][k] for r in rs]) for k in rs[0]["cpu_share"]
                },
                "cpu_us_per_req": {
                    k: spread([r["cpu_us_per_req"][k] for r in rs]) for k in rs[0]["cpu_us_per_req"]
                },
            }
            if not rs:
                continue
            if path != "direct":
                pairs = [
                    (get(path, stream, conns, k, paced), get("direct", stream, conns, k, paced))
                    for k in reps
                ]
                pairs = [(a, b) for a, b in pairs if a and b]
                case[path]["added_p50_ms"] = spread(
                    [(a["latency_us"]["p50"] - b["latency_us"]["p50"]) / 1000 for a, b in pairs]
                )
                case[path]["added_p99_ms"] = spread(
                    [(a["latency_us"]["p99"] - b["latency_us"]["p99"]) / 1000 for a, b in pairs]
                )
                if "rust" in paths and path == "edge":
                    ratios = []
                    for k in reps:
                        a = get("edge", stream, conns, k, paced)
                        b = get("rust", stream, conns, k, paced)
                        if a and b:
                            ratios.append(a["rps"] / b["rps"])
                    case[path]["rps_ratio_vs_rust"] = spread(ratios)
        out["cases"][key] = case
    chat1, chat64 = out["cases"]["chat-c1"], out["cases"]["chat-c64"]
    v1 = chat1["edge"]["added_p50_ms"]["median"]
    v2 = chat64["edge"]["added_p99_ms"]["median"]
    out["targets"]["added_p50_ms_c1"] = {"value": v1, "target": "<= 1.0", "met": v1 <= 1.0}
    out["targets"]["added_p99_ms_c64"] = {"value": v2, "target": "<= 5.0", "met": v2 <= 5.0}
    if "rps_ratio_vs_rust" in chat64["edge"]:
        v3 = chat64["edge"]["rps_ratio_vs_rust"]["median"]
        out["targets"]["rps_ratio_vs_rust_c64"] = {
            "value": v3,
            "target": ">= 0.8",
            "met": v3 >= 0.8,
        }
    else:
        out["targets"]["rps_ratio_vs_rust_c64"] = {"value": None, "target": ">= 0.8", "met": None}
    if "edge-metered" in paths:
        extra = []
        for k in reps:
            a, b = get("edge-metered", False, 64, k), get("edge", False, 64, k)
            if a and b:
                extra.append(a["cpu_us_per_req"]["router"] - b["cpu_us_per_req"]["router"])
        v4 = spread(extra)["median"]
        out["targets"]["metering_cpu_us_per_req_c64"] = {
            "value": v4,
            "target": "<= 5.0",
            "met": v4 <= 5.0,
        }
    if "edge-traced" in paths:
        out["targets"].update(_tracing_price(get, reps))
    paced = out["cases"].get("chat-c64-paced", {}).get("edge", {}).get("added_p99_ms")
    if paced:
        # Informative: the same 64 connections below saturation (~1000 req/s offered).
        out["targets"]["added_p99_ms_c64_paced"] = {
            "value": paced["median"],
            "target": "<= 5.0 (informative: 64 connections at ~1000 req/s)",
            "met": paced["median"] <= 5.0,
        }
    return out


def _tracing_price(get: Any, reps: list[int]) -> dict[str, dict[str, Any]]:
    """Informative: what tracing every request costs the edge, traced minus plain, per
    repetition (64 connections: CPU per request; one at a time: added p50)."""
    cpu, p50 = [], []
    for k in reps:
        a, b = get("edge-traced", False, 64, k), get("edge", False, 64, k)
        if a and b:
            cpu.append(a["cpu_us_per_req"]["router"] - b["cpu_us_per_req"]["router"])
        a, b = get("edge-traced", False, 1, k), get("edge", False, 1, k)
        if a and b:
            p50.append((a["latency_us"]["p50"] - b["latency_us"]["p50"]) / 1000)
    out: dict[str, dict[str, Any]] = {}
    if cpu:
        v = spread(cpu)["median"]
        out["tracing_cpu_us_per_req_c64"] = {"value": v, "target": "informative", "met": None}
    if p50:
        v = spread(p50)["median"]
        out["tracing_added_p50_ms_c1"] = {"value": v, "target": "informative", "met": None}
    return out


def render(result: dict[str, Any]) -> str:
    """The result as the Markdown tables of docs/benchmarks.md."""
    s = result["summary"]
    m = result["machine_before"]
    lines = [
        f"machine: nproc={m['nproc']} {m['cpu_model']}; load avg before "
        f"{'/'.join(f'{x:.2f}' for x in m['loadavg'])}, after "
        f"{'/'.join(f'{x:.2f}' for x in result['machine_after']['loadavg'])}; "
        f"reps={result['params']['reps']} x {result['params']['duration_s']:g}s; "
        f"git {result['git']}",
        "",
    ]

    def r(d: dict[str, float], nd: int = 2) -> str:
        return f"{fmt(d['median'], nd)} ({fmt(d['min'], nd)}..{fmt(d['max'], nd)})"

    def cpu(c: dict[str, Any], who: str) -> str:
        if who not in c["cpu_share"]:
            return "-"
        share = c["cpu_share"][who]["median"]
        per = c["cpu_us_per_req"][who]["median"]
        return f"{share:.2f} / {per:.0f}"

    rows = []
    for key, case in s["cases"].items():
        for path, c in case.items():
            rows.append(
                [
                    key,
                    path,
                    r(c["rps"], 0),
                    r(c["p50_ms"]),
                    r(c["p99_ms"]),
                    r(c["added_p50_ms"]) if "added_p50_ms" in c else "-",
                    r(c["added_p99_ms"]) if "added_p99_ms" in c else "-",
                    cpu(c, "router"),
                    cpu(c, "engine"),
                    cpu(c, "wrk"),
                    c["errors"],
                ]
            )
    header = ["case", "path", "req/s", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms",
              "router CPU share / µs per req", "engine CPU", "wrk CPU", "errors"]  # fmt: skip
    lines.append(markdown_table(header, rows))
    lines.append("")
    trows = []
    for name, t in s["targets"].items():
        met = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        if t["target"] == "informative" and t["value"] is not None:
            met = "informative"
        trows.append(
            [name, fmt(t["value"], 2) if t["value"] is not None else "n/a", t["target"], met]
        )
    lines.append(markdown_table(["target", "value (median)", "target", "verdict"], trows))
    if result["rust_router"] and not result["rust_router"].startswith("sglang-router"):
        lines.append(f"\nRust router not measured: {result['rust_router']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Measure every path; print the tables and write the JSON under var/bench/."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.overhead", description=__doc__.split("\n")[0]
    )
    # Five, not three: metering's target (5 µs) is a difference of two CPU-per-request figures
    # whose pairs spread over ±5 µs here; a median of three moved by as much as the target.
    ap.add_argument("--reps", type=int, default=5, help="repetitions of every case (default 5)")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per wrk run (default 4)")
    ap.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per path")
    ap.add_argument(
        "--usage-redis-url",
        default=os.environ.get("FEDINFER_BENCH_REDIS_URL", PRIVATE_REDIS),
        help="Redis the metered edge ships usage to: 'private' (default) starts the bench's own "
        "redis-server on the engine's core; a URL uses that Redis (its usage stream is deleted "
        "after the run); '' skips the metered path",
    )
    ap.add_argument(
        "--tracing",
        action="store_true",
        help="also measure the edge with tracing on (every request traced, exported to a "
        "local OTLP/HTTP sink); needs the tracing extra",
    )
    args = ap.parse_args(argv)
    if not 1 <= args.reps <= 20 or not 0.5 <= args.duration <= 60:
        ap.error("--reps must be 1..20 and --duration 0.5..60 s")
    run(
        reps=args.reps,
        duration=args.duration,
        warmup=args.warmup,
        usage_redis_url=args.usage_redis_url,
        tracing=args.tracing,
    )


if __name__ == "__main__":
    main()

__all__ = ["SGLANG_INSTALL", "main", "run"]
