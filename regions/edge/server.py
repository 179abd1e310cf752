"""A lean HTTP/1.1 server for the edge: ASGI ``http`` scopes over ``httptools``, nothing else.

Why not uvicorn (which the edge used before, and the engine simulator and control plane still
use): on the edge's hot path uvicorn's general machinery — an ``asyncio.Event`` and a flow-control
object per request, regex checks of every response header, a separate write for the head and
the body — cost about a third of the edge's CPU per request (docs/benchmarks.md §1), and the edge
is a proxy whose whole job is that hot path. This server keeps the same parser (httptools) and
the ASGI interface the edge is written against, and does only what the edge needs:

* keep-alive with an idle timeout, pipelined requests answered in order, ``Expect:
  100-continue``, request bodies streamed to ``receive()`` with backpressure;
* responses with ``content-length`` or chunked framing; the head goes out in the same write as
  the first body bytes (one syscall for a whole non-streamed answer); writes wait for the
  transport to drain when a slow client lets its buffer fill;
* ``http.disconnect`` from ``receive()`` once the client is gone (or the response is complete),
  so the edge can cancel the upstream request;
* a malformed request gets 400, oversized request heads 431, an application error 500, and
  the connection is closed; response header values with CR/LF/NUL are refused;
* graceful shutdown: stop accepting, close idle connections, let in-flight requests finish
  (bounded), then cancel what is left.

Lifespan is not an ASGI concern here: the CLI awaits the edge's ``startup()``/``shutdown()``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools

log = logging.getLogger("fedinfer.edge.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: A request head (request line + headers) larger than this is refused with 431.
MAX_HEAD_BYTES = 64 * 1024
#: Stop reading a request body the application has not consumed beyond this many bytes.
_BODY_HIGH_WATER = 256 * 1024

_STATUS_LINES = {
    s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode("latin-1") for s in HTTPStatus
}
_DISCONNECT: Message = {"type": "http.disconnect"}
_ASGI = {"version": "3.0", "spec_version": "2.3"}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


def _plain(status: int, text: bytes) -> bytes:
    return (
        _status_line(status)
        + b"content-type: text/plain; charset=utf-8\r\ncontent-length: "
        + str(len(text)).encode()
        + b"\r\nconnection: close\r\n\r\n"
        + text
    )


class _Clock:
    """The ``date`` header, formatted once per second rather than per response."""

    __slots__ = ("header", "second")

    def __init__(self) -> None:
        self.second = -1
        self.header = b""

    def date(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.header = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self.header


class _Cycle:
    """One request/response exchange; its ``receive`` and ``send`` are the ASGI callables."""

    __slots__ = (
        "_body",
        "_body_done",
        "_buffered",
        "_chunked",
        "_continue",
        "_delivered",
        "_head",
        "_remaining",
        "_waiter",
        "conn",
        "disconnected",
        "head_method",
        "keep_alive",
        "response_complete",
        "response_started",
        "scope",
    )

    def __init__(self, conn: _Connection, scope: Scope, keep_alive: bool, expect: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.head_method = scope["method"] == "HEAD"
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self._continue = expect
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._body_done = False
        self._delivered = False
        self._waiter: asyncio.Future[None] | None = None
        self._head = b""
        self._chunked = False
        self._remaining = 0

    # -- fed by the connection

    def feed(self, data: bytes) -> None:
        self._body.append(data)
        self._buffered += len(data)
        if self._buffered > _BODY_HIGH_WATER:
            self.conn.pause_reading()
        self._wake()

    def body_done(self) -> None:
        self._body_done = True
        self._wake()

    def lost(self) -> None:
        self.disconnected = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- ASGI

    async def receive(self) -> Message:
        if self._continue and not self._body_done:
            self._continue = False
            self.conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while True:
            if self.disconnected:
                return _DISCONNECT
            if self._body or (self._body_done and not self._delivered):
                body = self._body
                data = body.popleft() if len(body) == 1 else b"".join(body)
                body.clear()
                self._buffered = 0
                self._delivered = self._body_done
                self.conn.resume_reading()
                return {"type": "http.request", "body": data, "more_body": not self._body_done}
            if self.response_complete:
                return _DISCONNECT
            self._waiter = self.conn.loop.create_future()
            await self._waiter

    async def send(self, message: Message) -> None:
        conn = self.conn
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected http.response.start, got {kind}")
            self._start(message["status"], message.get("headers", ()))
            return
        if self.response_complete or kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind} after the response")
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        head, self._head = self._head, b""
        if self.head_method:
            out = head
        elif self._chunked:
            out = head + (b"%x\r\n%b\r\n" % (len(body), body) if body else b"")
            if not more:
                out += b"0\r\n\r\n"
        else:
            self._remaining -= len(body)
            if self._remaining < 0:
                raise RuntimeError("response body longer than its content-length")
            out = head + body if head else body
        if out:
            conn.write(out)
        if not more:
            if self._remaining > 0 and not self.head_method:
                raise RuntimeError("response body shorter than its content-length")
            self.response_complete = True
            self._wake()
            conn.response_done(self)

    def _start(self, status: int, headers: Any) -> None:
        parts = [_status_line(status), self.conn.server.clock.date()]
        lines = 3  # status line, date, the blank line that ends the head
        length: int | None = None
        for name, value in headers:
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                continue
            parts += (name, b": ", value, b"\r\n")
            lines += 1
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
            lines += 1
        if length is not None:
            self._remaining = length
        elif not (self.head_method or status in (204, 304) or status < 200):
            self._chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
            lines += 1
        parts.append(b"\r\n")
        head = b"".join(parts)
        # Each line of the head ends in the one CRLF put there above: a CR, LF or NUL inside a
        # header (e.g. passed through from an upstream) would split or corrupt the response.
        if head.count(b"\n") != lines or head.count(b"\r") != lines or b"\0" in head:
            raise RuntimeError("invalid character in a response header")
        self._head = head
        self.response_started = True
        self._continue = False

    async def run(self, app: ASGIApp) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            self.conn.close()
            raise
        except Exception:
            log.exception("error in the edge while answering %s", self.scope.get("path"))
            if not self.response_started and not self.disconnected:
                self.conn.write(_plain(500, b"Internal Server Error"))
            self.conn.close()
            return
        if not self.response_complete and not self.disconnected:
            log.error("response to %s was not completed", self.scope.get("path"))
            if not self.response_started:
                self.conn.write(_plain(500, b"Internal Server Error"))
            self.conn.close()


class _Connection(asyncio.Protocol):
    """One client connection; requests on it are answered one at a time, in order."""

    def __init__(self, server: EdgeServer) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.active: _Cycle | None = None
        self.parsing: _Cycle | None = None
        self.pipeline: deque[_Cycle] = deque()
        self.write_paused = False
        self.closed = False
        self._drain: asyncio.Future[None] | None = None
        self._read_paused = False
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._in_head = False
        self._idle: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        self.local = (local[0], local[1]) if isinstance(local, tuple) else None
        self.server.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, b"Upgrade is not supported")
        except (httptools.HttpParserError, _HeadTooLarge) as exc:
            if isinstance(exc, _HeadTooLarge) or isinstance(exc.__context__, _HeadTooLarge):
                self._refuse(431, b"Request head too large")
            else:
                self._refuse(400, b"Invalid HTTP request")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        for cycle in (self.active, self.parsing, *self.pipeline):
            if cycle is not None:
                cycle.lost()
        self.pipeline.clear()
        self._release_drain()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._release_drain()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._count(len(name) + len(value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self.parser
        url = httptools.parse_url(self._url)
        raw_path = url.path
        scope: Scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": parser.get_http_version(),
            "server": self.local,
            "client": self.client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": unquote(raw_path.decode("ascii", "replace")),
            "raw_path": raw_path,
            "query_string": url.query or b"",
            "headers": self._headers,
        }
        expect = any(n == b"expect" and v.lower() == b"100-continue" for n, v in self._headers)
        cycle = _Cycle(self, scope, parser.should_keep_alive(), expect)
        self.parsing = cycle
        if self.active is None:
            self._start(cycle)
        else:
            self.pipeline.append(cycle)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        if self.parsing is not None:
            self.parsing.feed(body)

    def on_message_complete(self) -> None:
        if self.parsing is not None:
            self.parsing.body_done()
            self.parsing = None

    # -- used by cycles

    def _start(self, cycle: _Cycle) -> None:
        self.active = cycle
        self.server.track(self.loop.create_task(cycle.run(self.server.app)))

    def response_done(self, cycle: _Cycle) -> None:
        if not cycle.keep_alive or cycle is self.parsing:
            # Answered before its body was all in (e.g. 413): do not read the rest.
            self.close()
            return
        self.active = None
        if self.pipeline:
            self._start(self.pipeline.popleft())
            if not self.pipeline:
                self.resume_reading()
        elif self.server.stopping:
            self.close()
        else:
            self._arm_idle()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    async def drain(self) -> None:
        if self._drain is None:
            self._drain = self.loop.create_future()
        await self._drain

    def pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None and not self.closed:
            self._read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._read_paused and self.transport is not None and not self.closed:
            self._read_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()

    @property
    def idle(self) -> bool:
        return self.active is None and not self._in_head

    # -- internals

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge

    def _refuse(self, status: int, text: bytes) -> None:
        if self.active is None or not self.active.response_started:
            self.write(_plain(status, text))
        self.close()

    def _arm_idle(self) -> None:
        self._idle = self.loop.call_later(self.server.keep_alive_s, self._idle_timeout)

    def _idle_timeout(self) -> None:
        self._idle = None
        if self.idle:
            self.close()

    def _release_drain(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)


class _HeadTooLarge(Exception):
    pass


class EdgeServer:
    """Serves one ASGI app on ``host:port`` until :meth:`stop` (or SIGINT/SIGTERM in ``run``)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keep_alive_s: float = 5.0,
        graceful_s: float = 30.0,
    ) -> None:
        self.app = app
        self.keep_alive_s = keep_alive_s
        self.graceful_s = graceful_s
        self.clock = _Clock()
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._stopped = asyncio.Event()

    def track(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def start(self, host: str, port: int, backlog: int = 2048) -> int:
        """Listen; returns the bound port (useful with ``port=0``)."""
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog
        )
        return int(self._server.sockets[0].getsockname()[1])

    def stop(self) -> None:
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def shutdown(self) -> None:
        """Stop accepting, close idle connections, give in-flight requests ``graceful_s``."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.idle:
                conn.close()
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=self.graceful_s)
            for task in pending:
                task.cancel()
            if pending:
                log.warning("shutdown: cancelled %d unfinished requests", len(pending))
                await asyncio.wait(pending, timeout=5)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()

    def handle_signals(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self.stop)
