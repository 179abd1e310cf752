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
closed after ``keep_alive_s``. Time the server itself did not run (the process paused, the loop
blocked) is not held against a client: ``connection.py`` says how its deadlines allow for it.

Lifespan is not an ASGI concern here: the CLI awaits the edge's ``startup()``/``shutdown()``.

This module is the listening server (:class:`EdgeServer`, :class:`ServerLimits`, the refusal
counts, shutdown) and the ASGI types the edge is written against; ``connection.py`` holds the
protocol of one client connection (parsing, pipelining, deadlines, refusals) and
``exchange.py`` one request/response exchange (``receive()``/``send()``, response framing).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from regions.edge.http.connection import Connection
from regions.edge.http.exchange import Clock
from regions.edge.http.stopping import SLOW_STOP_S, await_chain

log = logging.getLogger("fedinfer.edge.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Default of ``ServerLimits.max_head_bytes``: a larger request head is refused with 431.
MAX_HEAD_BYTES = 64 * 1024
#: The keys of ``EdgeServer.refusals``.
REFUSALS = (
    "head_too_large",
    "head_timeout",
    "body_timeout",
    "write_timeout",
    "too_many_connections",
    "bad_request",
)


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
        self.clock = Clock()
        self.connections: set[Connection] = set()
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
            lambda: Connection(self), host, port, backlog=backlog, reuse_port=reuse_port or None
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
