"""The edge server's limits against hostile clients: head size, timeouts, connections, framing.

Each test drives the real server over loopback with small limits and timeouts (tenths of a
second), so a limit that does not hold shows as a test timing out rather than as a slow suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

import pytest

from regions.edge.http import connection as edge_connection
from regions.edge.http.server import REFUSALS, EdgeServer, Message, Receive, Send
from tests.unit.test_edge_server import _post, _response, echo_app, run


class _Calls:
    """An echo app that records the requests it was called for."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        self.paths.append(scope["path"])
        await echo_app(scope, receive, send)


async def _rest(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes the connection (b"" if it resets it)."""
    try:
        return await asyncio.wait_for(reader.read(), 2)
    except ConnectionResetError:
        return b""


async def _until(check: Any) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached within 2 s")


def _only(reason: str) -> dict[str, int]:
    """The refusal counters after exactly one refusal, for ``reason``."""
    return {r: int(r == reason) for r in REFUSALS}


def test_limits_and_refusal_counters_default_to_the_documented_values() -> None:
    async def main() -> None:
        server = EdgeServer(echo_app)
        limits = (
            server.limits.keep_alive_s,
            server.limits.graceful_s,
            server.limits.max_head_bytes,
            server.limits.max_headers,
            server.limits.head_timeout_s,
            server.limits.body_timeout_s,
            server.limits.write_timeout_s,
            server.limits.max_connections,
        )
        assert limits == (5.0, 30.0, 64 * 1024, 100, 10.0, 30.0, 30.0, 10_000)
        assert server.refusals == dict.fromkeys(REFUSALS, 0)

    asyncio.run(main())


# -- 1. head size


@pytest.mark.parametrize(
    "start",
    [b"GET /", b"GET / HTTP/1.1\r\nx-name-", b"GET / HTTP/1.1\r\nhost: x\r\nx-value: "],
    ids=["url", "header-name", "header-value"],
)
def test_a_head_that_never_ends_is_cut_at_the_limit(start: bytes) -> None:
    app = _Calls()

    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(start)

        async def trickle() -> None:  # 200 separate reads of 256 bytes, no CRLF ever
            with contextlib.suppress(ConnectionError):
                for _ in range(200):
                    await asyncio.sleep(0.002)
                    writer.write(b"a" * 256)
                    await writer.drain()

        feeder = asyncio.create_task(trickle())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        feeder.cancel()
        assert head.startswith(b"HTTP/1.1 431") and b"connection: close" in head
        assert server.refusals == _only("head_too_large") and app.paths == []
        writer.close()

    run(app, test, max_head_bytes=2048)


@pytest.mark.parametrize(("count", "status"), [(100, b"200"), (101, b"431")])
def test_header_count_is_bounded(count: int, status: bytes) -> None:
    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        headers = b"".join(b"x-h%d: v\r\n" % i for i in range(count - 1))
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n")
        head, _ = await asyncio.wait_for(_response(reader), 2)
        assert head.startswith(b"HTTP/1.1 " + status)
        writer.close()

    run(echo_app, test)


# -- 2. timeouts and connections


@pytest.mark.parametrize("trickle", [True, False], ids=["byte-by-byte", "one-byte"])
def test_a_slow_head_gets_408_at_the_head_timeout(trickle: bool) -> None:
    app = _Calls()

    async def test(port: int, server: EdgeServer) -> None:
        loop = asyncio.get_running_loop()
        # Before connecting: the server's clock starts at its accept, which a busy loop can run
        # before this coroutine resumes from open_connection.
        started = loop.time()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"G")

        async def slowloris() -> None:  # never completes the head, never pauses long
            with contextlib.suppress(ConnectionError):
                for byte in b"ET / HTTP/1.1\r\nx-slow: " + b"a" * 1000:
                    await asyncio.sleep(0.05)
                    writer.write(bytes([byte]))

        feeder = asyncio.create_task(slowloris()) if trickle else None
        head, _ = await asyncio.wait_for(_response(reader), 2)
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head
        assert 0.3 <= loop.time() - started < 1.5  # the head timeout, not keep-alive's 5 s
        assert await _rest(reader) == b""
        assert server.refusals == _only("head_timeout") and app.paths == []
        if feeder is not None:
            feeder.cancel()
        writer.close()

    run(app, test, head_timeout_s=0.3)


def test_a_connection_that_sends_nothing_is_closed_after_keep_alive_without_an_answer() -> None:
    async def test(port: int, server: EdgeServer) -> None:
        loop = asyncio.get_running_loop()
        # Before connecting: the server's clock starts at its accept, which a busy loop can run
        # before this coroutine resumes from open_connection.
        started = loop.time()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await _rest(reader) == b""
        assert 0.3 <= loop.time() - started < 1.5
        assert server.refusals == dict.fromkeys(REFUSALS, 0)  # an idle close is no refusal
        writer.close()

    run(echo_app, test, keep_alive_s=0.3, head_timeout_s=5)


@pytest.mark.parametrize("sends", [True, False], ids=["request-after-the-pause", "silent"])
def test_time_the_server_did_not_run_is_not_held_against_a_fresh_connection(
    monkeypatch: pytest.MonkeyPatch, sends: bool
) -> None:
    """The machine pauses (server and client alike) past the keep-alive deadline of a connection
    just accepted. As both resume, the server's overdue timer runs before the client's request
    arrives: without the stall rule it closed the connection unanswered ("Server disconnected
    without sending a response", seen in CI on a fresh /healthz connection). A client that stays
    silent after the pause is still closed, the pause given back once."""
    monkeypatch.setattr(edge_connection, "STALL_S", 0.3)

    async def test(port: int, server: EdgeServer) -> None:
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await _until(lambda: server.connections)
        # A blocking sleep on purpose: nothing on the loop runs, 0.6 s past the 0.2 s deadline.
        time.sleep(0.8)  # noqa: ASYNC251
        await asyncio.sleep(0.05)  # the overdue timer runs before the client writes
        if sends:
            writer.write(_post(b"/after-the-pause", b""))
            answer = await asyncio.wait_for(_response(reader), 2)
            assert answer[1] == b"POST /after-the-pause ? "
        else:
            started = loop.time()
            assert await _rest(reader) == b""
            assert 0.4 <= loop.time() - started < 1.5  # the 0.6 s pause given back, no more
        assert server.refusals == dict.fromkeys(REFUSALS, 0)
        writer.close()

    run(echo_app, test, keep_alive_s=0.2, head_timeout_s=5)


def test_a_busy_keep_alive_connection_outlives_its_idle_timeout() -> None:
    """The lazily re-armed timer closes only after keep_alive_s of idleness, not of age."""

    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(6):  # 0.6 s in all, each gap well under the 0.25 s idle timeout
            writer.write(_post(b"/%d" % i, b""))
            assert (await asyncio.wait_for(_response(reader), 2))[1] == b"POST /%d ? " % i
            await asyncio.sleep(0.1)
        assert await _rest(reader) == b""
        writer.close()

    run(echo_app, test, keep_alive_s=0.25)


@pytest.mark.parametrize(
    ("head", "part"),
    [
        (b"content-length: 10\r\n", b"abc"),
        (b"transfer-encoding: chunked\r\n", b"3\r\nabc\r\n"),
    ],
    ids=["content-length", "chunked"],
)
def test_a_stalled_request_body_disconnects_the_app_at_the_body_timeout(
    head: bytes, part: bytes
) -> None:
    seen: list[tuple[str, bytes, float]] = []

    async def reading_app(scope: Any, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            now = asyncio.get_running_loop().time()
            seen.append((message["type"], message.get("body", b""), now))
            if not message.get("more_body"):
                return

    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /u HTTP/1.1\r\nhost: x\r\n" + head + b"\r\n" + part)
        assert await _rest(reader) == b""  # dropped, no answer
        assert [kind for kind, _, _ in seen] == ["http.request", "http.disconnect"]
        assert seen[0][1] == b"abc"
        assert 0.3 <= seen[1][2] - seen[0][2] < 1.5
        assert server.refusals == _only("body_timeout")
        await _until(lambda: not server.connections)
        writer.close()

    run(reading_app, test, body_timeout_s=0.3)


def test_a_slow_body_that_keeps_arriving_is_not_cut() -> None:
    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 6\r\n\r\n")
        for byte in b"abcdef":  # 0.6 s in all, a byte every 0.1 s: under the 0.25 s timeout
            await asyncio.sleep(0.1)
            writer.write(bytes([byte]))
        head, body = await asyncio.wait_for(_response(reader), 2)
        assert head.startswith(b"HTTP/1.1 200") and body == b"POST /slow ? abcdef"
        assert server.refusals == dict.fromkeys(REFUSALS, 0)
        writer.close()

    run(echo_app, test, body_timeout_s=0.25)


def test_a_pipelined_head_behind_a_slow_answer_is_not_timed_out() -> None:
    """The server stops reading behind a queued request; that wait is not the client's."""

    async def slow_echo(scope: Any, receive: Receive, send: Send) -> None:
        await asyncio.sleep(0.25)
        await echo_app(scope, receive, send)

    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"/1", b"") + _post(b"/2", b"") + b"POST /3 HTTP/1.1\r\nhost:")
        await asyncio.sleep(0.1)
        writer.write(b" x\r\ncontent-length: 0\r\n\r\n")
        bodies = [(await asyncio.wait_for(_response(reader), 2))[1] for _ in range(3)]
        assert bodies == [b"POST /1 ? ", b"POST /2 ? ", b"POST /3 ? "]
        assert server.refusals == dict.fromkeys(REFUSALS, 0)
        writer.close()

    run(slow_echo, test, head_timeout_s=0.2)


def test_connections_past_the_cap_get_503_without_the_app() -> None:
    app = _Calls()

    async def test(port: int, server: EdgeServer) -> None:
        first = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await _until(lambda: len(server.connections) == 2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head, _ = await asyncio.wait_for(_response(reader), 2)
        assert head.startswith(b"HTTP/1.1 503")
        assert b"connection: close\r\n" in head and b"retry-after: 1\r\n" in head
        assert await _rest(reader) == b"" and app.paths == []
        assert server.refusals == _only("too_many_connections")
        writer.close()
        first[0][1].close()  # one leaves: a newcomer is served again
        await _until(lambda: len(server.connections) == 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"/in", b""))
        assert (await asyncio.wait_for(_response(reader), 2))[1] == b"POST /in ? "
        writer.close()
        first[1][1].close()

    run(app, test, max_connections=2)


# -- 3. clients that stop reading


def _not_reading_client(port: int, request: bytes) -> socket.socket:
    """A client with a small receive buffer that sends ``request`` and then never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


def test_a_client_that_stops_reading_a_stream_is_dropped_at_the_write_timeout() -> None:
    seen: list[str] = []
    gone = asyncio.Event()

    async def firehose(scope: Any, receive: Receive, send: Send) -> None:
        await receive()  # the (empty) body

        async def watch() -> None:
            message: Message = await receive()
            seen.append(message["type"])
            gone.set()

        watcher = asyncio.create_task(watch())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        chunk = b"x" * 65536
        while not gone.is_set():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await watcher

    async def test(port: int, server: EdgeServer) -> None:
        sock = _not_reading_client(port, _post(b"/stream", b""))
        try:
            await asyncio.wait_for(gone.wait(), 2)
            assert seen == ["http.disconnect"]
            assert server.refusals == _only("write_timeout")
            await _until(lambda: not server.connections)
        finally:
            sock.close()

    run(firehose, test, write_timeout_s=0.3)


def test_a_closing_connection_whose_answer_is_never_read_is_aborted() -> None:
    """A whole answer written at once never waits to drain; closing would wait to flush it."""

    async def big_app(scope: Any, receive: Receive, send: Send) -> None:
        await receive()
        body = b"x" * (32 * 1024 * 1024)
        headers = [(b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def test(port: int, server: EdgeServer) -> None:
        sock = _not_reading_client(port, _post(b"/big", b""))
        try:
            await _until(lambda: server.refusals["write_timeout"] == 1)
            await _until(lambda: not server.connections)
        finally:
            sock.close()

    run(big_app, test, write_timeout_s=0.3)


# -- 4. request smuggling


@pytest.mark.parametrize(
    "framing",
    [
        b"content-length: 3\r\ntransfer-encoding: chunked\r\n",
        b"transfer-encoding: chunked\r\ncontent-length: 3\r\n",
        b"content-length: 3\r\ncontent-length: 4\r\n",
        b"content-length: 3\r\ncontent-length: 3\r\n",
        b"content-length: 3, 3\r\n",
        b"transfer-encoding: gzip\r\n",
        b"transfer-encoding: identity\r\n",
        b"transfer-encoding: gzip, chunked\r\n",
        b"transfer-encoding: chunked, chunked\r\n",
        b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n",
        b"connection: upgrade\r\nupgrade: h2c\r\ncontent-length: 0\r\n",
    ],
    ids=[
        "cl-then-te",
        "te-then-cl",
        "two-cl",
        "same-cl-twice",
        "cl-list",
        "te-gzip",
        "te-identity",
        "te-gzip-chunked",
        "te-chunked-twice-in-one",
        "te-twice",
        "upgrade",
    ],
)
def test_ambiguous_framing_or_an_upgrade_is_refused_before_the_app(framing: bytes) -> None:
    app = _Calls()

    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /s HTTP/1.1\r\nhost: x\r\n" + framing + b"\r\n3\r\nabc\r\n0\r\n\r\n"
            b"GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n"
        )
        head, _ = await asyncio.wait_for(_response(reader), 2)
        assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head
        assert await _rest(reader) == b""
        assert app.paths == [] and server.refusals == _only("bad_request")
        writer.close()

    run(app, test)


def test_transfer_encoding_chunked_in_any_case_is_served() -> None:
    """Transfer coding names are case-insensitive (RFC 9112 §7); httptools parses it alike."""

    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: Chunked\r\n\r\n"
            b"3\r\nabc\r\n0\r\n\r\n"
        )
        assert (await asyncio.wait_for(_response(reader), 2))[1] == b"POST /c ? abc"
        writer.close()

    run(echo_app, test)
