"""An OTLP/HTTP sink for the benchmarks' traced edge: a small server in a process of its own
that reads each batch of spans, answers 200 and counts what it got, so that exporting costs the
edge what it costs against a real collector without a collector's CPU on the router's core."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from regions.supervisor import Supervisor, free_port, wait_http

SINK = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
stats_path = sys.argv[2]
seen = {"batches": 0, "bytes": 0}
class Sink(BaseHTTPRequestHandler):
    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        self.rfile.read(n)
        seen["batches"] += 1
        seen["bytes"] += n
        with open(stats_path, "w") as out:
            json.dump(seen, out)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
"""


def start_otlp_sink(pg: Supervisor, stats: Path, cpus: set[int]) -> str:
    """The sink, pinned to ``cpus``, counting into ``stats`` (JSON); its traces URL."""
    port = free_port()
    proc = pg.start("otlp-sink", [sys.executable, "-c", SINK, str(port), str(stats)], cpus=cpus)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, watch=proc)
    return f"{url}/v1/traces"


def sink_stats(stats: Path) -> dict[str, Any]:
    """What the sink received: batches and bytes (none when nothing was exported)."""
    if not stats.exists():
        return {"batches": 0, "bytes": 0}
    data: dict[str, Any] = json.loads(stats.read_text())
    return data
