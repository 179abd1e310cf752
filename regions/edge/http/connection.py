"""One client connection of the edge server: an ``asyncio.Protocol`` fed to ``httptools``.

:class:`Connection` parses requests, answers pipelined ones in order, one
:class:`~regions.edge.http.exchange.Cycle` (``exchange.py``: the ASGI ``receive``/``send``) at a
time, refuses hostile or broken clients (``server.py`` lists the refusals and the limits behind
them) and keeps the connection's deadlines. It is the server's per-connection half; the
listening half (accepting, counting refusals, shutting down) stays in ``server.py``.

All the deadlines of a connection (idle keep-alive, request head, request body, write) share
one timer, set lazily: a state change moves a deadline (one clock read) and re-arms the timer
only when the new deadline is earlier than the armed one; a timer that fires early re-arms for
what is pending. Time the server itself did not run is not held against a client: a timer that
fires more than :data:`STALL_S` late (the process was descheduled or paused, or the loop
blocked) gives each of the connection's deadlines that delay again, counted from no earlier
than now, once: bytes the client sent as the machine resumed are read before it is judged, so
a fresh connection whose request comes right after such a pause is served rather than closed
unanswered.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, cast
from urllib.parse import unquote

import httptools

from regions.edge.http.exchange import Cycle, plain_response

if TYPE_CHECKING:
    from regions.edge.http.server import EdgeServer, Scope

#: A connection timer this late means the server was not running (see the module docstring).
STALL_S = 1.0
# What the read-side deadline of a connection is for (one at a time).
_IDLE, _HEAD, _BODY = 1, 2, 3

_ASGI = {"version": "3.0", "spec_version": "2.3"}


class Connection(asyncio.Protocol):
    """One client connection; requests on it are answered one at a time, in order."""

    def __init__(self, server: EdgeServer) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.active: Cycle | None = None
        self.parsing: Cycle | None = None
        self.pipeline: deque[Cycle] = deque()
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
            self.transport.write(
                plain_response(503, b"Too many connections", b"retry-after: 1\r\n")
            )
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
        cycle = Cycle(self, scope, parser.should_keep_alive(), self._expect)
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

    def _start(self, cycle: Cycle) -> None:
        self.active = cycle
        self.server.track(self.loop.create_task(cycle.run(self.server.app)))

    def response_done(self, cycle: Cycle) -> None:
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
            self.write(plain_response(status, text))
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
