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
so vLLM's, is 5 s), and https:// origins with verified certificates (system CAs, or a CA bundle:
:func:`client_ssl_context`).

What a misbehaving upstream cannot do: hold the edge's memory with a response head over
``max_head_bytes`` (64 KiB) or a non-streamed answer over ``max_body_bytes`` (64 MiB) — both an
:class:`UpstreamError` with the connection closed — or answer the next request on a connection
with bytes it sent beyond an answer's framing or while the connection idled in the pool (such a
connection is closed, never reused).

Retries: one, transparent, only when a *reused* connection was closed or reset by the server
before a byte of the answer (the race every keep-alive client has: it closed the idle connection
as the request went out); never after a timeout, when the engine may be working on it.
:attr:`UpstreamError.sent` tells the caller whether the request may have reached the upstream.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

#: Stop reading from the upstream when this much body is buffered and unread.
_HIGH_WATER = 256 * 1024


#: How a connection the server dropped ends (besides EOF): a reused one it never answered on.
_DROPPED = (ConnectionResetError, BrokenPipeError)


class UpstreamError(Exception):
    """The upstream did not (fully) answer: refused, reset, closed, timed out, malformed, too large.

    ``sent`` is False only when connecting failed (refused, connect timeout, TLS handshake):
    then the request cannot have reached the upstream and another one may be tried. True once
    its bytes were written, whatever came after: the upstream may be running it.

    ``dropped``: the upstream itself closed or reset the connection (it crashed, or gave the
    request up): it is no longer running the request (vLLM aborts a request whose connection
    is gone). A timeout, a malformed or oversized answer is not ``dropped``: the engine may
    still be working when the edge gives up.
    """

    def __init__(self, message: str, *, sent: bool = True, dropped: bool = False) -> None:
        super().__init__(message)
        self.sent = sent
        self.dropped = dropped


def client_ssl_context(ca_file: str | None) -> ssl.SSLContext:
    """Verifies upstream certificates (and host names) against the PEM bundle ``ca_file``
    (only those CAs: a private PKI), or the system's CAs when None."""
    return ssl.create_default_context(cafile=ca_file)


class _Origin:
    __slots__ = ("authority", "host", "port", "ssl")

    def __init__(self, base_url: str, pool: UpstreamPool) -> None:
        parts = urlsplit(base_url)
        tls = parts.scheme == "https"
        if not (tls or parts.scheme == "http") or not parts.hostname:
            raise ValueError(f"upstream URL must be http(s)://host[:port], got {base_url!r}")
        default_port = 443 if tls else 80
        self.host = parts.hostname
        self.port = parts.port or default_port
        self.ssl = pool.ssl_context() if tls else None
        authority = f"[{self.host}]" if ":" in self.host else self.host
        if self.port != default_port:
            authority += f":{self.port}"
        #: The host header's value.
        self.authority = authority.encode("latin-1")


class Response:
    """One upstream response: status and headers at once, the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_limit",
        "_waiter",
        "_whole",
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
        #: Unread bytes beyond which :meth:`_overflow` acts: the high-water mark, or
        #: ``max_body_bytes`` once :meth:`read` takes the answer whole.
        self._limit = _HIGH_WATER
        self._whole = False

    # -- fed by the connection

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > self._limit:
            self._overflow()
        self._wake()

    def _overflow(self) -> None:
        if not self._whole:
            self._conn.pause()  # streamed: read on once the client has taken it
            return
        self._chunks.clear()
        if self._error is None:
            self._error = UpstreamError("answer too large")
        self._conn.close()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if not self._done and self._error is None:  # the first failure is the cause
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
        """The whole body, whatever its size up to the pool's ``max_body_bytes`` (beyond it an
        :class:`UpstreamError`, the connection closed). Reads on past the streaming high-water
        mark, so the connection goes back to the pool reading."""
        conn = self._conn
        self._whole = True
        self._limit = conn.pool.max_body_bytes
        if self._buffered > self._limit:
            self._overflow()
        conn.resume()
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

    def abandon(self, error: UpstreamError) -> None:
        """Give the answer up while it is being read: the reader gets ``error``, the engine
        a closed connection (a stream moved off a drained instance)."""
        self._fail(error)
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
        #: The server closed or reset it (not us, not a timeout): on a reused connection with
        #: no byte of answer, the request was not taken.
        self.dropped = False
        self.keep_alive = False
        self.idle_since = 0.0
        self.received = False
        self._paused = False
        #: A request is out and its answer not complete: another answer is not one.
        self._expecting = False
        self._in_head = False
        #: Bytes the response head may still take.
        self._head_room = 0
        self._headers: dict[bytes, bytes] = {}
        self._head: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._until_close = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self._in_head:
            room = self._head_room
            if len(data) > room:
                # Parse what the head may take; the rest only if the head ended within it.
                self.data_received(data[:room])
                if self._in_head:
                    self._abandon(UpstreamError("response head too large"))
                elif not self.closed:
                    self.data_received(data[room:])
                return
            self._head_room = room - len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._abandon(UpstreamError(f"malformed response: {exc}"))

    def eof_received(self) -> bool:
        return False  # let the transport close; connection_lost settles the response

    def connection_lost(self, exc: Exception | None) -> None:
        self.dropped = not self.closed and (exc is None or isinstance(exc, _DROPPED))
        self.closed = True
        self.pool._forget(self)
        response = self._response
        if response is not None and self._until_close and exc is None:
            response._finish()  # a body delimited by the connection's end
        else:
            why = f"connection lost: {exc.__class__.__name__}" if exc else "connection closed"
            self._settle_error(UpstreamError(why, dropped=self.dropped))

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if not self._expecting:
            # An answer no request is waiting for (after the one that completed, or on an idle
            # connection) must not become the next request's: stops the parser, which closes
            # the connection (a complete answer before it stands).
            raise UpstreamError("data after the answer")
        self._headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self._in_head = False
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
        self._expecting = False
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
        self._expecting = self._in_head = True
        self._head_room = self.pool.max_head_bytes
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
        max_head_bytes: int = 64 * 1024,
        max_body_bytes: int = 64 * 1024 * 1024,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """``max_body_bytes`` bounds answers taken whole (:meth:`Response.read`), not streams;
        ``ssl_context`` verifies https origins (default: the system's CAs)."""
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle = max_idle_per_origin
        self.max_head_bytes = max_head_bytes
        self.max_body_bytes = max_body_bytes
        self._ssl_context = ssl_context
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
            origin = self._origins[base_url] = _Origin(base_url, self)
        parts = [
            b"POST ",
            path.encode("latin-1"),
            b" HTTP/1.1\r\nhost: ",
            origin.authority,
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
                if conn.received or not conn.dropped:
                    raise
                # The server closed (or reset) this idle connection as we reused it, without a
                # byte of answer: it did not take the request, so it goes out again on a fresh
                # connection. Not after a timeout: the engine may be working on it.
        conn = await self._connect(base_url, origin)
        return await self._exchange(conn, data)

    def ssl_context(self) -> ssl.SSLContext:
        """What https origins are verified with: the one given, else the system's CAs (loaded
        with the first https origin: ~20 ms)."""
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        return self._ssl_context

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
            # wait_for, not asyncio.timeout: its task lets what a server sends on accept (bytes,
            # a close) arrive before the request goes out. A cancellation landing in the very turn
            # the connect completes is lost: that request then runs to its end for nobody.
            _, conn = await asyncio.wait_for(  # noqa: TID251
                self.loop.create_connection(
                    lambda: _Connection(self, key, origin),
                    origin.host,
                    origin.port,
                    ssl=origin.ssl,
                    server_hostname=origin.host if origin.ssl is not None else None,
                ),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            why = f"connect: {exc.__class__.__name__}"
            if isinstance(exc, ssl.SSLError):
                why += f" ({exc})"
            raise UpstreamError(why, sent=False) from exc
        if conn.closed:  # it spoke or hung up first: closed before the request went out
            raise UpstreamError("connect: closed by the server", sent=False)
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
