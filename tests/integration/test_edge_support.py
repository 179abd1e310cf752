"""Processes for the edge's integration tests: a tiny vLLM-like fake engine and the edge itself.

The fake engine speaks just enough of vLLM's OpenAI server (chat and completions, streaming and
not, usage with ``cached_tokens`` from a chained-block prefix cache, ``/health``, ``/metrics``
with vLLM's names) to drive the edge over real sockets; ``/stats`` tells a test what it saw.
Everything binds to loopback on free ports and is killed in fixture teardown.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from regions.supervisor import (
    Process,
    file_written,
    free_port,
    start_process,
    wait_http,
    wait_until,
)

FAKE_ENGINE = r"""
import argparse, asyncio, hashlib, json, time
from aiohttp import web

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--name", required=True)
p.add_argument("--model", default="llama")
p.add_argument("--adapters", default="sql")
p.add_argument("--tokens", type=int, default=5)
p.add_argument("--token-delay", type=float, default=0.0)
o = p.parse_args()

blocks = set()
state = {"requests": 0, "aborted": 0, "running": 0, "traceparents": [], "prompts": []}

def render(body):
    if "messages" in body:
        return "".join(f"{m['role']}\n{m['content']}\n\n" for m in body["messages"])
    return body["prompt"] if isinstance(body["prompt"], str) else json.dumps(body["prompt"])

def cache(prompt):
    # 16 "tokens" of 4 characters per block, chained like vLLM's prefix cache.
    h, hit, miss = b"", 0, False
    n = len(prompt) // 64
    for i in range(n):
        h = hashlib.sha1(h + prompt[i * 64:(i + 1) * 64].encode()).digest()
        if h in blocks and not miss:
            hit += 1
        else:
            miss = True
        blocks.add(h)
    return hit * 16

async def completion(request):
    body = await request.json()
    if body.get("model") not in [o.model, *o.adapters.split(",")]:
        return web.json_response({"error": {"message": "no such model", "type": "NotFoundError",
                                  "param": None, "code": 404}}, status=404)
    chat = request.path.endswith("chat/completions")
    state["requests"] += 1
    state["traceparents"].append(request.headers.get("traceparent", ""))
    prompt = render(body)
    state["prompts"].append(prompt[-40:])
    prompt_tokens = len(prompt) // 4 + 1
    cached = cache(prompt)
    n = body.get("max_tokens") or o.tokens
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
             "total_tokens": prompt_tokens + n,
             "prompt_tokens_details": {"cached_tokens": cached}}
    words = [f"{o.name}:" if i == 0 else f" t{i}" for i in range(n)]
    rid, created = f"cmpl-{state['requests']}", int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    state["running"] += 1
    try:
        if not body.get("stream"):
            await asyncio.sleep(o.token_delay * n)
            text = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length", "logprobs": None} if chat else
                      {"index": 0, "text": text, "finish_reason": "length", "logprobs": None})
            return web.json_response({"id": rid, "object": obj, "created": created,
                                      "model": o.model, "choices": [choice], "usage": usage,
                                      "system_fingerprint": request.headers.get("traceparent", "")})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            for i, w in enumerate(words):
                await asyncio.sleep(o.token_delay)
                if chat:
                    delta = {"content": w} if i else {"role": "assistant", "content": w}
                    choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
                else:
                    choice = {"index": 0, "text": w, "finish_reason": None, "logprobs": None}
                chunk = {"id": rid, "object": obj, "created": created, "model": o.model,
                         "choices": [choice]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if (body.get("stream_options") or {}).get("include_usage"):
                chunk = {"id": rid, "object": obj, "created": created, "model": o.model,
                         "choices": [], "usage": usage}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            state["aborted"] += 1
            raise
        return resp
    finally:
        state["running"] -= 1

async def health(request):
    return web.Response(text="")

async def metrics(request):
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="{o.model}"}} {state["running"]}\n'
        f'vllm:num_requests_waiting{{model_name="{o.model}"}} 0\n'
        f'vllm:kv_cache_usage_perc{{model_name="{o.model}"}} 0.1\n'
    )
    return web.Response(text=text, content_type="text/plain")

async def stats(request):
    return web.json_response(state)

app = web.Application()
app.router.add_post("/v1/chat/completions", completion)
app.router.add_post("/v1/completions", completion)
app.router.add_get("/health", health)
app.router.add_get("/metrics", metrics)
app.router.add_get("/stats", stats)
web.run_app(app, host="127.0.0.1", port=o.port, print=None, access_log=None)
"""


@dataclass
class Engine:
    name: str
    port: int
    proc: Process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/stats", timeout=2).json())


@contextlib.contextmanager
def engine_sims(tmp: Path, count: int, model: str, *args: str) -> Iterator[list[dict[str, Any]]]:
    """``count`` simulated engines in one ``fedinfer engine-sim`` process on free ports; yields
    the engines of its ready file (``index``, ``url``, …) and stops the process afterwards."""
    ready = tmp / "ready.json"
    fedinfer = str(Path(sys.executable).with_name("fedinfer"))
    cmd = [fedinfer, "engine-sim", "--count", str(count), "--port", "0", "--model", model, *args]
    sim = start_process("engine-sim", [*cmd, "--ready-file", str(ready)], log=tmp / "sim.log")
    try:
        written = functools.partial(file_written, ready)
        wait_until(written, what="engine-sim's ready file", watch=sim)
        yield list(json.loads(ready.read_text())["engines"])
    finally:
        sim.stop()


def spawn_engine(tmp: Path, name: str, *args: str) -> Engine:
    """Start a fake engine without waiting for it (see :func:`regions.supervisor.wait_http`)."""
    script = tmp / "fake_engine.py"
    if not script.exists():
        script.write_text(FAKE_ENGINE)
    port = free_port()
    argv = [sys.executable, str(script), "--port", str(port), "--name", name, *args]
    return Engine(name, port, start_process(name, argv, log=tmp / f"engine-{name}.log"))


def table_doc(region: str, version: int, instances: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "version": version,
        "region": region,
        "generated_at": "2026-11-29T09:00:00Z",
        "instances": instances,
        "remote_regions": [],
    }


def instance(engine: Engine, **kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": engine.name,
        "url": engine.url,
        "model": "llama",
        "max_concurrency": 16,
        "prefill_tokens_per_s": 8000,
    }
    doc.update(kw)
    return doc


@dataclass
class EdgeProc:
    port: int
    proc: Process
    table: Path
    log: Path
    ops_port: int = 0
    engines: dict[str, Engine] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ops(self) -> str:
        """The operator listener (/healthz, /metrics)."""
        return f"http://127.0.0.1:{self.ops_port}"


def start_edge(tmp: Path, table: dict[str, Any], *args: str) -> EdgeProc:
    path = tmp / "table.json"
    path.write_text(json.dumps(table))
    port, ops_port = free_port(), free_port()
    log = tmp / f"edge-{port}.log"
    fedinfer = str(Path(sys.executable).parent / "fedinfer")
    cmd = [fedinfer, "edge", "--region", table["region"], "--table", str(path)]
    cmd += ["--port", str(port), "--operator-port", str(ops_port)]
    cmd += ["--probe-interval", "0.2", "--scrape-interval", "0.2"]
    cmd += ["--table-poll", "0.2", "--log-level", "warning", *args]
    proc = start_process("edge", cmd, log=log)
    edge = EdgeProc(port, proc, path, log, ops_port)
    try:
        wait_http(edge.ops + "/healthz", watch=proc)
    except Exception:
        proc.stop()
        raise
    return edge


@contextlib.contextmanager
def cluster(
    tmp: Path,
    n: int,
    *,
    engine_args: tuple[str, ...] = (),
    edge_args: tuple[str, ...] = (),
    **inst_kw: Any,
) -> Iterator[EdgeProc]:
    """``n`` fake engines (``i-1`` …) behind one edge of region ``r1``."""
    engines: list[Engine] = []
    edge: EdgeProc | None = None
    try:
        for k in range(1, n + 1):
            engines.append(spawn_engine(tmp, f"i-{k}", *engine_args))
        for e in engines:
            wait_http(e.url + "/health", watch=e.proc)
        table = table_doc("r1", 1, [instance(e, **inst_kw) for e in engines])
        edge = start_edge(tmp, table, *edge_args)
        edge.engines = {e.name: e for e in engines}
        yield edge
    finally:
        if edge is not None:
            edge.proc.stop()
        for e in engines:
            e.proc.stop()


def admitted(edge: EdgeProc) -> bool:
    """Whether the edge's probes have admitted every instance of its table (``/healthz``)."""
    detail = httpx.get(edge.ops + "/healthz", timeout=5).json()["detail"]
    return bool(detail) and all(d["healthy"] for d in detail.values())


def wait_admitted(*edges: EdgeProc) -> None:
    """Until every one of ``edges`` has admitted every instance (instead of a fixed pause)."""
    for edge in edges:
        wait_until(lambda e=edge: admitted(e), what="every instance admitted", watch=edge.proc)


def route_of(headers: Any) -> dict[str, str]:
    """``x-fedinfer-route`` as a dict of its ``key=value`` parts."""
    raw = headers.get("x-fedinfer-route", "")
    return dict(part.split("=", 1) for part in raw.split(";") if "=" in part)
