"""The edge's HTTP/1.1 server, driven over loopback sockets by raw requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from regions.edge.http.server import (
    MAX_HEAD_BYTES,
    EdgeServer,
    Message,
    Receive,
    Send,
    ServerLimits,
)
from regions.edge.http.stopping import await_chain, stop_step

Scope = dict[str, Any]


async def echo_app(scope: Any, receive: Receive, send: Send) -> None:
    """Echoes method, path, query and body; ``/boom`` raises, ``/stream`` sends three chunks."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/boom":
        raise ValueError("boom")
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"a", b"bb", b"ccc"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    out = b"%s %s ?%s %s" % (
        scope["method"].encode(),
        scope["path"].encode(),
        scope["query_string"],
        body,
    )
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(out)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": out})


async def _with_server(
    app: Callable[[Any, Receive, Send], Awaitable[None]],
    test: Callable[[int, EdgeServer], Awaitable[None]],
    **kw: Any,
) -> None:
    server = EdgeServer(app, ServerLimits(**kw))
    port = await server.start("127.0.0.1", 0)
    try:
        await test(port, server)
    finally:
        await server.shutdown()


def run(app: Any, test: Callable[[int, EdgeServer], Awaitable[None]], **kw: Any) -> None:
    asyncio.run(_with_server(app, test, **kw))


async def _response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of one response framed by content-length or chunked encoding."""
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return head, body
            body += chunk[:-2]
    for line in lower.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return head, await reader.readexactly(int(line.split(b":")[1]))
    return head, b""


def _post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%b\r\n%b" % (
        path,
        len(body),
        extra,
        body,
    )


def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"/a?x=1", b"one") + _post(b"/b%20c", b"two"))
        head1, body1 = await _response(reader)
        _, body2 = await _response(reader)
        assert head1.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\ndate: " in head1
        assert body1 == b"POST /a ?x=1 one"
        assert body2 == b"POST /b c ? two"
        writer.write(_post(b"/again", b"3"))
        assert (await _response(reader))[1] == b"POST /again ? 3"
        writer.close()

    run(echo_app, test)


def test_chunked_request_body_and_chunked_streamed_response() -> None:
    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /e HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )
        assert (await _response(reader))[1] == b"POST /e ? abcde"
        writer.write(_post(b"/stream", b""))
        head, body = await _response(reader)
        assert b"transfer-encoding: chunked" in head and body == b"abbccc"
        writer.close()

    run(echo_app, test)


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /c HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\nexpect: 100-continue\r\n\r\n"
        )
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"body")
        assert (await _response(reader))[1] == b"POST /c ? body"
        writer.close()

    run(echo_app, test)


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"NOT HTTP\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\r\nx-big: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n", b"431"),
        (_post(b"/boom", b"x"), b"500"),
    ],
)
def test_bad_requests_and_app_errors_get_a_status_and_a_closed_connection(
    raw: bytes, status: bytes
) -> None:
    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        head, _ = await _response(reader)
        assert head.startswith(b"HTTP/1.1 " + status)
        assert b"connection: close" in head
        assert await reader.read() == b""  # the server closed the connection
        writer.close()

    run(echo_app, test)


def test_client_disconnect_reaches_receive() -> None:
    seen: list[str] = []
    gate: list[asyncio.Event] = []

    async def waiting_app(scope: Any, receive: Receive, send: Send) -> None:
        await receive()  # the body
        gate[0].set()
        message: Message = await receive()  # blocks until the client goes away
        seen.append(message["type"])

    async def test(port: int, server: EdgeServer) -> None:
        gate.append(asyncio.Event())
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"/w", b"x"))
        await asyncio.wait_for(gate[0].wait(), 2)
        writer.close()
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert seen == ["http.disconnect"]

    run(waiting_app, test)


def test_idle_keep_alive_connection_is_closed_after_the_timeout() -> None:
    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"/a", b""))
        await _response(reader)
        assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()

    run(echo_app, test, keep_alive_s=0.2)


def test_shutdown_lets_in_flight_requests_finish() -> None:
    async def slow_app(scope: Any, receive: Receive, send: Send) -> None:
        await receive()
        await asyncio.sleep(0.3)
        headers = [(b"content-length", b"4")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"done"})

    async def main() -> None:
        server = EdgeServer(slow_app, ServerLimits(graceful_s=5))
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"/s", b""))
        await asyncio.sleep(0.05)
        await server.shutdown()
        head, body = await _response(reader)
        assert head.startswith(b"HTTP/1.1 200") and body == b"done"
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)  # no longer accepting
        writer.close()

    asyncio.run(main())


@pytest.mark.parametrize("value", [b"a\r\nset-cookie: b", b"a\nset-cookie: b", b"a\rb", b"a\0b"])
def test_response_header_injection_is_refused(value: bytes) -> None:
    async def bad_app(scope: Any, receive: Receive, send: Send) -> None:
        await receive()
        headers = [(b"content-type", b"text/plain"), (b"x-evil", value)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

    async def test(port: int, server: EdgeServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"/", b""))
        head, _ = await _response(reader)
        assert head.startswith(b"HTTP/1.1 500") and b"set-cookie" not in head
        writer.close()

    run(bad_app, test)


def test_a_stop_that_waits_can_say_where_each_task_is_suspended() -> None:
    async def inner(gate: asyncio.Event) -> None:
        await gate.wait()

    async def outer(gate: asyncio.Event) -> None:
        await inner(gate)

    async def main() -> None:
        gate = asyncio.Event()
        task = asyncio.create_task(outer(gate), name="scrape-loop")
        await asyncio.sleep(0)
        where = await_chain(task)
        assert where.startswith("scrape-loop at outer:") and " > inner:" in where
        assert " > wait:" in where  # down into the Event it waits on
        gate.set()
        await task

    asyncio.run(main())


def test_a_stop_step_that_hangs_is_named_cancelled_and_left() -> None:
    """A step of a stop that never ends is logged with where it waits, then abandoned: the
    stop goes on (a step that ends in time, or fails, behaves as a plain await)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("test.stop_step")
    log.addHandler(Collect())
    cancelled = []

    async def hangs() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def fails() -> None:
        raise RuntimeError("broken")

    async def main() -> None:
        await stop_step("the hanging step", hangs(), log, timeout_s=0.05)
        await stop_step("a quick step", asyncio.sleep(0), log, timeout_s=1.0)
        with pytest.raises(RuntimeError, match="broken"):
            await stop_step("a failing step", fails(), log, timeout_s=1.0)

    asyncio.run(main())
    assert cancelled == [True]
    assert len(records) == 1 and records[0].startswith("stop: the hanging step still running")
    assert "hangs:" in records[0]  # where it waited
