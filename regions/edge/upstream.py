"""The edge's HTTP/1.1 client for its hot path: keep-alive pools to engines and remote edges.

Why not aiohttp (which the edge used before): the edge already holds the exact request bytes
and needs only the status, three headers and the body passed through. aiohttp's request and
response objects, header multidicts, payload writers and connector bookkeeping cost ~40 % of
the edge's CPU per request (docs/benchmarks.md §1). This is an :class:`asyncio.Protocol` over
``httptools``' response parser (the C parser uvicorn uses) with a LIFO pool of idle keep-alive
connections per origin: one ``write`` per request, parser callbacks straight into the response.

What it keeps from a full client: connect and read timeouts, backpressure (a slow client pauses
reading from the upstream instead of buffering a whole stream), keep-alive only when the server
allows it, idle connections retired before the server's own keep-alive timeout (uvicorn's, and
so vLLM's, is 5 s), and one transparent retry when a *reused* connection turns out to have been
closed by the server before it read the request (the race every keep-alive client has).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

#: Stop reading from the upstream when this much body is buffered and unread.
_HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    """The upstream did not (fully) answer: refused, reset, closed, timed out or malformed."""


class _Origin:
    __slots__ = ("host", "hostport", "port")

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream URL must be http://host[:port], got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.hostport = f"{parts.hostname}:{self.port}".encode("latin-1")


class Response:
    """One upstream response: status and headers at once, the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_waiter",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection, status: int, headers: dict[bytes, bytes]) -> None:
        self._conn = conn
        self.status = status
        #: Lower-case names; a repeated header keeps its last value (the edge reads only
        #: content-type, retry-after and x-fedinfer-route).
        self.headers = headers
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- fed by the connection

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if not self._done:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the edge

    async def _wait(self) -> None:
        waiter = self._waiter = self._conn.loop.create_future()
        await self._conn.wait(waiter)

    async def readany(self) -> bytes:
        """What has arrived since the last call (at least one byte), or b"" at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        while not self._done:
            if self._error is not None:
                raise self._error
            await self._wait()
        if self._error is not None:
            raise self._error
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        return data

    def release(self) -> None:
        """Done with it: a fully read response returns its connection to the pool."""
        conn = self._conn
        if self._done and self._error is None and conn.keep_alive and not conn.closed:
            conn.pool_put()
        else:
            conn.close()

    def close(self) -> None:
        """Drop the connection: how an engine learns that the request was abandoned."""
        self._conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request at a time (no pipelining)."""

    def __init__(self, pool: UpstreamPool, key: str, origin: _Origin) -> None:
        self.pool = pool
        self.key = key
        self.origin = origin
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.keep_alive = False
        self.idle_since = 0.0
        self.received = False
        self._paused = False
        self._headers: dict[bytes, bytes] = {}
        self._head: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._until_close = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._abandon(UpstreamError(f"malformed response: {exc}"))

    def eof_received(self) -> bool:
        return False  # let the transport close; connection_lost settles the response

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        response = self._response
        if response is not None and self._until_close and exc is None:
            response._finish()  # a body delimited by the connection's end
        else:
            why = f"connection lost: {exc.__class__.__name__}" if exc else "connection closed"
            self._settle_error(UpstreamError(why))

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        headers = self._headers
        status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self._until_close = b"content-length" not in headers and b"chunked" not in headers.get(
            b"transfer-encoding", b""
        )
        response = self._response = Response(self, status, headers)
        head = self._head
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._response is not None:
            self._response._finish()

    # -- used by the pool and the response

    async def wait(self, fut: asyncio.Future[Any]) -> None:
        """Await ``fut`` within the read timeout."""
        timer = self.loop.call_later(self.pool.read_timeout_s, _expire, fut)
        try:
            await fut
        finally:
            timer.cancel()

    def send(self, data: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.received = False
        self._response = None
        head: asyncio.Future[Response] = self.loop.create_future()
        self._head = head
        self.transport.write(data)
        return head

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def pool_put(self) -> None:
        self._response = None
        self._head = None
        self.idle_since = time.monotonic()
        self.pool._put(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()
        self._settle_error(UpstreamError("connection closed"))

    def _abandon(self, error: UpstreamError) -> None:
        self._settle_error(error)
        self.close()

    def _settle_error(self, error: UpstreamError) -> None:
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error)
        if self._response is not None:
            self._response._fail(error)


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(UpstreamError("read timeout"))


class UpstreamPool:
    """Keep-alive connections per origin, shared by all requests of one event loop."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        idle_timeout_s: float = 4.0,
        max_idle_per_origin: int = 256,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle = max_idle_per_origin
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[str, list[_Connection]] = {}
        self._all: set[_Connection] = set()

    async def post(
        self, base_url: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> Response:
        """POST ``body`` (JSON) to ``base_url + path``; returns once the status line and
        headers are in. Raises :class:`UpstreamError` when nothing usable came back."""
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = _Origin(base_url)
        parts = [
            b"POST ",
            path.encode("latin-1"),
            b" HTTP/1.1\r\nhost: ",
            origin.hostport,
            b"\r\ncontent-type: application/json\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\n",
        ]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"\r\n", body)
        data = b"".join(parts)
        conn = self._take(base_url)
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except UpstreamError:
                if conn.received:
                    raise
                # The server closed this idle connection as we reused it: it never saw the
                # request, so sending it again on a fresh connection is safe.
        conn = await self._connect(base_url, origin)
        return await self._exchange(conn, data)

    async def _exchange(self, conn: _Connection, data: bytes) -> Response:
        head = conn.send(data)
        try:
            await conn.wait(head)
        except BaseException:
            conn.close()
            raise
        return head.result()

    def _take(self, key: str) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        cutoff = time.monotonic() - self.idle_timeout_s
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if conn.idle_since < cutoff:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, key: str, origin: _Origin) -> _Connection:
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Connection(self, key, origin), origin.host, origin.port
                ),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"connect: {exc.__class__.__name__}") from exc
        self._all.add(conn)
        return conn

    def _put(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle:
            conn.close()
            return
        idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)

    async def close(self) -> None:
        """Close every connection (idle or in use)."""
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)
