"""One request/response exchange of the edge server: the ASGI ``receive`` and ``send``.

:class:`Cycle` is what the application sees of a request (``server.py`` describes the server):
``receive()`` hands it the request body as the connection reads it (sending ``100 Continue``
first if the client asked), then ``http.disconnect``; ``send()`` turns its response messages into
bytes on the wire, with ``content-length`` or chunked framing, the head held back to go out in
the same write as the first body bytes; ``run()`` calls the application and answers 500 if it
fails. The connection (``connection.py``) parses requests, keeps the deadlines, feeds each
cycle the body bytes it reads and writes what the cycle frames.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from regions.edge.http.connection import Connection
    from regions.edge.http.server import ASGIApp, Message, Scope

log = logging.getLogger("fedinfer.edge.server")

#: Stop reading a request body the application has not consumed beyond this many bytes.
_BODY_HIGH_WATER = 256 * 1024

_STATUS_LINES = {
    s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode("latin-1") for s in HTTPStatus
}
_DISCONNECT: Message = {"type": "http.disconnect"}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


def plain_response(status: int, text: bytes, extra: bytes = b"") -> bytes:
    """A whole ``text/plain`` answer that closes the connection (an error or a refusal)."""
    return (
        _status_line(status)
        + b"content-type: text/plain; charset=utf-8\r\ncontent-length: "
        + str(len(text)).encode()
        + b"\r\nconnection: close\r\n"
        + extra
        + b"\r\n"
        + text
    )


class Clock:
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


class Cycle:
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

    def __init__(self, conn: Connection, scope: Scope, keep_alive: bool, expect: bool) -> None:
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
                self.conn.write(plain_response(500, b"Internal Server Error"))
            self.conn.close()
            return
        if not self.response_complete and not self.disconnected:
            log.error("response to %s was not completed", self.scope.get("path"))
            if not self.response_started:
                self.conn.write(plain_response(500, b"Internal Server Error"))
            self.conn.close()
