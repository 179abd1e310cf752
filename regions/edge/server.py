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
* an application error gets 500 and the connection is closed; response header values with
  CR/LF/NUL are refused;
* graceful shutdown: stop accepting, close idle connections, let in-flight requests finish
  (bounded), then cancel what is left.

Hostile or broken clients are refused before the application sees them, each refusal counted
in ``EdgeServer.refusals`` under its reason (for the edge's metrics):

* ``head_too_large`` — 431 for a request head over ``max_head_bytes`` (raw bytes, so a header
  line or URL that never ends is cut too: httptools would buffer it without a callback) or
  with more than ``max_headers`` headers;
* ``head_timeout`` — 408 when a request head has not fully arrived ``head_timeout_s`` after its
  first byte (slowloris);
* ``body_timeout`` — the connection is dropped when the application waits ``body_timeout_s``
  for request body bytes that do not come; its ``receive()`` returns ``http.disconnect``;
* ``write_timeout`` — the connection is dropped when a client that stopped reading keeps the
  transport paused for ``write_timeout_s`` (a send waiting to drain, or a closing connection
  whose last bytes cannot be flushed); ``receive()`` returns ``http.disconnect`` and further
  sends are no-ops, so the edge cancels its upstream request;
* ``too_many_connections`` — past ``max_connections`` open connections a new one gets 503 with
  ``retry-after: 1`` and is closed;
* ``bad_request`` — 400 for a malformed request, an upgrade, or ambiguous body framing (both
  content-length and transfer-encoding, two content-lengths, a transfer-encoding other than
  ``chunked``: request smuggling material; httptools refuses most, the server the rest).

A refusal closes the connection; it is answered only when no earlier pipelined request is still
being answered (the answer would be taken for that one's). Idle keep-alive connections are
closed after ``keep_alive_s``. All these deadlines share one timer per connection, set lazily:
a state change moves a deadline (one clock read) and re-arms the timer only when the new
deadline is earlier than the armed one; a timer that fires early re-arms for what is pending.
Time the server itself did not run is not held against a client: a timer that fires more than
:data:`STALL_S` late (the process was descheduled or paused, or the loop blocked) gives each
of the connection's deadlines that delay again, counted from no earlier than now, once: bytes
the client sent as the machine resumed are read before it is judged, so a fresh connection whose
request comes right after such a pause is served rather than closed unanswered.

Lifespan is not an ASGI concern here: the CLI awaits the edge's ``startup()``/``shutdown()``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools

log = logging.getLogger("fedinfer.edge.server")

#: After this long, a stop that still waits says what for (``await_chain``).
SLOW_STOP_S = 5.0


def await_chain(task: asyncio.Future[Any]) -> str:
    """Where a task is suspended: its coroutines from the outermost in, ``name:line`` each."""
    where: list[str] = []
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    while coro is not None and len(where) < 32:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
    return f"{name} at " + " > ".join(where)


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Default of ``ServerLimits.max_head_bytes``: a larger request head is refused with 431.
MAX_HEAD_BYTES = 64 * 1024
#: Stop reading a request body the application has not consumed beyond this many bytes.
_BODY_HIGH_WATER = 256 * 1024
#: The keys of ``EdgeServer.refusals``.
REFUSALS = (
    "head_too_large",
    "head_timeout",
    "body_timeout",
    "write_timeout",
    "too_many_connections",
    "bad_request",
)
#: A connection timer this late means the server was not running (see the module docstring).
STALL_S = 1.0
# What the read-side deadline of a connection is for (one at a time).
_IDLE, _HEAD, _BODY = 1, 2, 3

_STATUS_LINES = {
    s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode("latin-1") for s in HTTPStatus
}
_DISCONNECT: Message = {"type": "http.disconnect"}
_ASGI = {"version": "3.0", "spec_version": "2.3"}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


def _plain(status: int, text: bytes, extra: bytes = b"") -> bytes:
    return (
        _status_line(status)
        + b"content-type: text/plain; charset=utf-8\r\ncontent-length: "
        + str(len(text)).encode()
        + b"\r\nconnection: close\r\n"
        + extra
        + b"\r\n"
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

    @property
    def waiting_for_body(self) -> bool:
        waiter = self._waiter
        return not self._body_done and waiter is not None and not waiter.done()

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
            if not self._body_done:
                self.conn.wait_body()
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
        more: bool = message.get("more_body", False)
        out = self._frame(message.get("body", b""), more)
        if out:
            conn.write(out)
        if not more:
            if self._remaining > 0 and not self.head_method:
                raise RuntimeError("response body shorter than its content-length")
            self.response_complete = True
            self._wake()
            conn.response_done(self)

    def _frame(self, body: bytes, more: bool) -> bytes:
        """The bytes one body message puts on the wire: the held head first, then the body as
        the head framed it (chunked, or counted against its content-length)."""
        head, self._head = self._head, b""
        if self.head_method:
            return head
        if self._chunked:
            out = head + (b"%x\r\n%b\r\n" % (len(body), body) if body else b"")
            return out if more else out + b"0\r\n\r\n"
        self._remaining -= len(body)
        if self._remaining < 0:
            raise RuntimeError("response body longer than its content-length")
        return head + body if head else body

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
        self._expect = False
        self._head_bytes = 0  # URL and header bytes, as the parser's callbacks report them
        self._head_raw = 0  # bytes of reads that fell wholly inside the current head
        # The one timer and the deadlines it serves (0.0: none); see the module docstring.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._read_kind = 0  # _IDLE, _HEAD or _BODY
        self._read_by = 0.0
        self._write_by = 0.0
        self._excused = False  # the deadlines were moved for a stall of the server

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        server = self.server
        if len(server.connections) >= server.limits.max_connections:
            server.refusals["too_many_connections"] += 1
            self.transport.write(_plain(503, b"Too many connections", b"retry-after: 1\r\n"))
            self.close()
            return
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        self.local = (local[0], local[1]) if isinstance(local, tuple) else None
        server.connections.add(self)
        self._read_deadline(_IDLE, server.limits.keep_alive_s)

    def data_received(self, data: bytes) -> None:
        head = self._headers if self._read_kind == _HEAD else None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            refused = exc.__context__
            if isinstance(refused, _Refused):
                self._refuse(refused.status, refused.reason, refused.text)
            else:
                self._refuse(400, "bad_request", b"Invalid HTTP request")
            return
        if head is self._headers and self._read_kind == _HEAD:
            # The whole read lies inside one unfinished head: count it raw, since httptools
            # buffers a header line that does not end without calling back.
            self._head_raw += len(data)
            if self._head_raw > self.server.limits.max_head_bytes:
                self._refuse(431, "head_too_large", b"Request head too large")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        for cycle in (self.active, self.parsing, *self.pipeline):
            if cycle is not None:
                cycle.lost()
        self.pipeline.clear()
        self._release_drain()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if not self.closed:  # a closing connection keeps its deadline to flush
            self._write_by = 0.0
        self._release_drain()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect = False
        self._head_bytes = self._head_raw = 0
        self._read_deadline(_HEAD, self.server.limits.head_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        headers = self._headers
        headers.append((name, value))
        self._count(len(name) + len(value))
        if len(headers) > self.server.limits.max_headers:
            raise _Refused(431, "head_too_large", b"Too many request headers")
        if name == b"transfer-encoding":
            # httptools refuses content-length with it, but takes "gzip, chunked" (a body the
            # edge would pass on undecoded) and refuses "gzip" only once the app has started.
            if value.lower() != b"chunked":
                raise _Refused(400, "bad_request", b"Unsupported transfer-encoding")
        elif name == b"expect" and value.lower() == b"100-continue":
            self._expect = True

    def on_headers_complete(self) -> None:
        parser = self.parser
        if parser.should_upgrade():  # WebSocket, h2c, CONNECT; httptools says so only later
            raise _Refused(400, "bad_request", b"Upgrade is not supported")
        self._read_kind = 0
        self._read_by = 0.0
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
        cycle = _Cycle(self, scope, parser.should_keep_alive(), self._expect)
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
        self._read_kind = 0  # no more body to wait for
        self._read_by = 0.0
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
        elif self._read_kind != _HEAD:  # a pipelined head under way keeps its own deadline
            self._read_deadline(_IDLE, self.server.limits.keep_alive_s)

    def wait_body(self) -> None:
        """The application waits for request body bytes: they must come within the timeout."""
        self._read_deadline(_BODY, self.server.limits.body_timeout_s)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    async def drain(self) -> None:
        if self._drain is None:
            self._drain = self.loop.create_future()
            self._write_by = at = self.loop.time() + self.server.limits.write_timeout_s
            self._arm(at)
        await self._drain

    def pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None and not self.closed:
            self._read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._read_paused and self.transport is not None and not self.closed:
            self._read_paused = False
            self.transport.resume_reading()
            if self._read_kind == _HEAD:
                # A head we stopped reading (behind pipelined requests) was not the client's
                # delay: it gets a whole timeout again.
                self._read_deadline(_HEAD, self.server.limits.head_timeout_s)

    def close(self) -> None:
        transport = self.transport
        if not self.closed and transport is not None:
            self.closed = True
            transport.close()
            if transport.get_write_buffer_size():
                # The close waits for the buffer to flush: bound that for a client not reading.
                self._write_by = at = self.loop.time() + self.server.limits.write_timeout_s
                self._arm(at)

    @property
    def idle(self) -> bool:
        return self.active is None and self._read_kind != _HEAD

    # -- internals

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.server.limits.max_head_bytes:
            raise _Refused(431, "head_too_large", b"Request head too large")

    def _refuse(self, status: int, reason: str, text: bytes) -> None:
        self.server.refusals[reason] += 1
        active = self.active
        # Answered only if no earlier request is still owed an answer: it would be taken for it.
        if active is None or (active is self.parsing and not active.response_started):
            self.write(_plain(status, text))
        self.close()

    def _drop(self, reason: str) -> None:
        """Abort a stalled connection (nothing worth flushing); ``connection_lost`` follows."""
        self.server.refusals[reason] += 1
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _read_deadline(self, kind: int, timeout: float) -> None:
        self._read_kind = kind
        self._read_by = at = self.loop.time() + timeout
        self._arm(at)

    def _arm(self, at: float) -> None:
        """Have the timer fire by ``at``; one due later is replaced, one due earlier is kept."""
        timer = self._timer
        if timer is not None:
            if self._timer_at <= at:
                return
            timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        """Act on the deadline that has passed, if any; re-arm for those still pending."""
        self._timer = None
        now = self.loop.time()
        late = now - self._timer_at
        if late > STALL_S and not self._excused:
            # Fired this late, the server was away: the client gets that time back, once.
            self._excused = True
            if self._read_by:
                self._read_by = max(self._read_by, now) + late
            if self._write_by:
                self._write_by = max(self._write_by, now) + late
            due = [at for at in (self._read_by, self._write_by) if at]
            if due:
                self._arm(min(due))
            return
        self._excused = False
        if self._write_by:
            if now >= self._write_by:
                self._drop("write_timeout")
                return
            self._arm(self._write_by)
        if self.closed or not self._read_by or self._read_paused:
            return  # reading paused by the server: not the client's delay
        if now < self._read_by:
            self._arm(self._read_by)
        elif self._read_kind == _IDLE:
            self.close()
        elif self._read_kind == _HEAD:
            self._refuse(408, "head_timeout", b"Request Timeout")
        elif self.active is not None and self.active.waiting_for_body:
            self._drop("body_timeout")
        # else the application is busy with what came: its next wait sets a new deadline

    def _release_drain(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)


class _Refused(Exception):
    """Raised in a parser callback to stop parsing: the request is refused with ``status``."""

    def __init__(self, status: int, reason: str, text: bytes) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.text = text


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What a client may take of the server (the module docstring, docs/security.md)."""

    max_connections: int = 10_000
    max_head_bytes: int = MAX_HEAD_BYTES
    max_headers: int = 100
    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    #: How long a shutdown waits for in-flight requests before it cancels them.
    graceful_s: float = 30.0


class EdgeServer:
    """Serves one ASGI app on ``host:port`` until :meth:`stop` (or SIGINT/SIGTERM in ``run``).

    ``limits`` are described in the module docstring; ``refusals`` counts what they refused.
    """

    def __init__(self, app: ASGIApp, limits: ServerLimits | None = None) -> None:
        self.app = app
        self.limits = limits or ServerLimits()
        self.refusals: dict[str, int] = dict.fromkeys(REFUSALS, 0)
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

    async def start(
        self, host: str, port: int, backlog: int = 2048, *, reuse_port: bool = False
    ) -> int:
        """Listen; returns the bound port (useful with ``port=0``). ``reuse_port``: beside
        the other worker processes of the edge, the kernel spreading connections over them."""
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_port=reuse_port or None
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
            grace = self.limits.graceful_s
            _, pending = await asyncio.wait(set(self.tasks), timeout=min(grace, SLOW_STOP_S))
            if pending and grace > SLOW_STOP_S:
                # Say what they wait for: a request that outlives a stop is worth seeing.
                log.warning(
                    "shutdown: %d requests in flight after %.0f s: %s",
                    len(pending), SLOW_STOP_S, "; ".join(await_chain(t) for t in pending),
                )  # fmt: skip
                _, pending = await asyncio.wait(pending, timeout=grace - SLOW_STOP_S)
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
