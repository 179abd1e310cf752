"""Asynchronous streaming chat client that replays a :class:`~bench.harness.workload.Workload`.

One asyncio task per session (uvloop, one pooled aiohttp session): it sleeps until the session's
start, then sends each turn as a streaming chat completion with the whole history, waits for the
answer, thinks, and sends the next turn. Time to first token (TTFT) is taken at the first SSE
chunk whose ``delta.content`` is not empty (vLLM's first chunk carries only the role). The
final usage chunk (``stream_options.include_usage``) gives prompt and cached tokens.

The client measures its own event-loop lag (a 10 ms ticker): when the client is starved of
CPU its timestamps are late, and the benchmark reports that instead of hiding it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.harness.workload import Session, Workload

__all__ = ["Record", "Target", "replay", "saturate"]


@dataclass(frozen=True, slots=True)
class Target:
    """Where the client sends: one base URL (an edge), the oracle's per-session engine, or
    several edges taken in turn per request (a per-request round-robin balancer)."""

    urls: tuple[str, ...]
    #: ``"single"``: always ``urls[0]``; ``"session_hash"``: crc32(session id) mod len(urls);
    #: ``"per_request"``: the next URL for every request, whatever its session or connection.
    mode: str = "single"
    #: Extra request headers (an ``Authorization`` key when the edges admit tenants).
    headers: tuple[tuple[str, str], ...] = ()
    _turn: itertools.count[int] = field(default_factory=itertools.count, compare=False)

    def url_for(self, session_id: str) -> str:
        if self.mode == "session_hash":
            return self.urls[zlib.crc32(session_id.encode()) % len(self.urls)]
        if self.mode == "per_request":
            return self.urls[next(self._turn) % len(self.urls)]
        return self.urls[0]


@dataclass(slots=True)
class Record:
    session: str
    turn: int
    sent: float  # seconds since the run's t0
    ttft: float = float("nan")
    e2e: float = float("nan")
    status: int = 0
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    route: str = ""  # x-fedinfer-route header (edge) or the engine URL (oracle)
    #: Seconds the request waited in the edge's gateway line (its ``Server-Timing: queue``).
    queue_s: float = 0.0
    url: str = ""
    text: str = field(default="", repr=False)


@dataclass
class RunState:
    t0: float
    records: list[Record] = field(default_factory=list)
    stop_sending: float = float("inf")  # no new request after this time (s since t0)
    lags: list[float] = field(default_factory=list)


async def _one_request(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    rec: Record,
    t0: float,
    timeout_s: float,
) -> None:
    start = time.perf_counter()
    rec.sent = start - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(f"{url}/v1/chat/completions", data=body, headers=headers) as resp:
                rec.status = resp.status
                rec.route = resp.headers.get("x-fedinfer-route", url)
                rec.queue_s = gateway_wait(resp.headers.get("server-timing", ""))
                if resp.status != 200:
                    rec.error = (await resp.read())[:200].decode(errors="replace")
                    return
                first = True
                parts: list[str] = []
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        break
                    chunk = orjson.loads(payload)
                    choices = chunk.get("choices")
                    if choices:
                        text = (choices[0].get("delta") or {}).get("content")
                        if text:
                            if first:
                                rec.ttft = time.perf_counter() - start
                                first = False
                            parts.append(text)
                    usage = chunk.get("usage")
                    if usage:
                        rec.prompt_tokens = usage.get("prompt_tokens") or 0
                        rec.completion_tokens = usage.get("completion_tokens") or 0
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = details.get("cached_tokens") or 0
                rec.text = "".join(parts)
                rec.e2e = time.perf_counter() - start
                if first:
                    rec.error = "no content chunk"
    except TimeoutError:
        rec.error = "timeout"
    except aiohttp.ClientError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]


def gateway_wait(server_timing: str) -> float:
    """The ``queue`` entry of an edge's ``Server-Timing`` header, in seconds (0 without)."""
    for part in server_timing.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name == "queue" and dur:
            return float(dur) / 1000
    return 0.0


def _body(
    workload: Workload, session: Session, turn: int, model: str, replies: list[str] | None
) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "messages": workload.messages(session, turn, replies),
            "max_tokens": session.turns[turn].max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": session.id,
        }
    )


async def _session(
    http: aiohttp.ClientSession,
    workload: Workload,
    session: Session,
    target: Target,
    model: str,
    state: RunState,
    timeout_s: float,
    *,
    honour_times: bool = True,
    resend_answers: bool = True,
) -> None:
    """One conversation. With ``resend_answers`` the history carries the answers the engine
    actually streamed (as a real chat client does; the simulator's answers depend only on the
    prompt and the engine seed, so every policy still sees the same requests), else the
    workload's generated answers."""
    loop_time = time.perf_counter
    if honour_times:
        delay = state.t0 + session.start_s - loop_time()
        if delay > 0:
            await asyncio.sleep(delay)
    headers = {"Content-Type": "application/json", "x-session-id": session.id}
    headers.update(target.headers)
    replies: list[str] | None = [] if resend_answers else None
    for k, turn in enumerate(session.turns):
        if loop_time() - state.t0 >= state.stop_sending:
            return
        url = target.url_for(session.id)  # per request: a balancer may send turns elsewhere
        rec = Record(session=session.id, turn=k, sent=0.0, url=url)
        state.records.append(rec)
        body = _body(workload, session, k, model, replies)
        await _one_request(http, url, body, headers, rec, state.t0, timeout_s)
        if rec.error:
            return  # a broken conversation does not go on
        if replies is not None:
            replies.append(rec.text)
        rec.text = ""
        if honour_times and turn.think_s > 0:
            await asyncio.sleep(turn.think_s)


async def _lag_probe(state: RunState, period: float = 0.01) -> None:
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period)
        state.lags.append(time.perf_counter() - t - period)


def _connector() -> aiohttp.TCPConnector:
    return aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=None, force_close=False)


async def replay(
    workload: Workload,
    target: Target,
    *,
    model: str,
    stop_sending_s: float,
    drain_timeout_s: float = 30.0,
    request_timeout_s: float = 60.0,
    on_tick: Callable[[float], Any] | None = None,
) -> RunState:
    """Replay ``workload`` open-loop (Poisson session starts) until ``stop_sending_s``.

    Requests already in flight at ``stop_sending_s`` are awaited (at most ``drain_timeout_s``),
    no new ones are sent. Returns every request's :class:`Record`.
    """
    state = RunState(t0=time.perf_counter() + 0.2, stop_sending=stop_sending_s)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(connector=_connector(), timeout=timeout) as http:
        probe = asyncio.create_task(_lag_probe(state))
        tasks = [
            asyncio.create_task(
                _session(http, workload, s, target, model, state, request_timeout_s)
            )
            for s in workload.sessions
            if s.start_s < stop_sending_s
        ]
        deadline = state.t0 + stop_sending_s + drain_timeout_s
        ticker = None
        if on_tick is not None:
            ticker = asyncio.create_task(_ticker(state, on_tick))
        try:
            await asyncio.wait(tasks, timeout=max(1.0, deadline - time.perf_counter()))
        finally:
            for t in (*tasks, probe, *([ticker] if ticker else [])):
                t.cancel()
            await asyncio.gather(*tasks, probe, *([ticker] if ticker else []),
                                 return_exceptions=True)  # fmt: skip
    return state


async def _ticker(state: RunState, on_tick: Callable[[float], Any]) -> None:
    while True:
        await asyncio.sleep(1.0)
        res = on_tick(time.perf_counter() - state.t0)
        if asyncio.iscoroutine(res):
            with contextlib.suppress(Exception):
                await res


async def saturate(
    workload: Workload,
    target: Target,
    *,
    model: str,
    concurrency: int,
    duration_s: float,
    request_timeout_s: float = 60.0,
) -> RunState:
    """Closed loop: ``concurrency`` users run the workload's sessions back to back, no think
    time, for ``duration_s``; measures the fleet's saturation throughput for this mix."""
    state = RunState(t0=time.perf_counter(), stop_sending=duration_s)
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in workload.sessions:
        queue.put_nowait(s)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)

    async def user() -> None:
        while not queue.empty() and time.perf_counter() - state.t0 < duration_s:
            s = queue.get_nowait()
            await _session(
                http, workload, s, target, model, state, request_timeout_s, honour_times=False
            )

    async with aiohttp.ClientSession(connector=_connector(), timeout=timeout) as http:
        probe = asyncio.create_task(_lag_probe(state))
        users = [asyncio.create_task(user()) for _ in range(concurrency)]
        try:
            await asyncio.wait(users, timeout=duration_s + request_timeout_s)
        finally:
            for t in (*users, probe):
                t.cancel()
            await asyncio.gather(*users, probe, return_exceptions=True)
    return state
