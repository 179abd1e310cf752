"""The edge's upstream HTTP/1.1 client against raw loopback servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from regions.edge.upstream import UpstreamError, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n"
        + extra
        + b"\r\n"
        + body
    )


async def _serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server counting its connections; returns (server, base URL, connection counter)."""
    conns = [0]

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns[0] += 1
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", conns


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_keep_alive_reuses_one_connection_and_sends_exact_request() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await _read_request(reader))
            writer.write(_ok(b'{"n":1}', b"x-fedinfer-route: region=x\r\n"))
            await writer.drain()

    async def main() -> None:
        server, url, conns = await _serve(handler)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=2)
        for _ in range(3):
            resp = await pool.post(
                url, "/v1/chat/completions", b'{"a":1}', [(b"traceparent", b"t")]
            )
            assert resp.status == 200
            assert resp.headers[b"x-fedinfer-route"] == b"region=x"
            assert await resp.read() == b'{"n":1}'
            resp.release()
        assert conns[0] == 1
        assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert b"\r\ntraceparent: t\r\n" in seen[0] and seen[0].endswith(b'\r\n\r\n{"a":1}')
        await pool.close()
        server.close()

    run(main())


def test_reused_connection_closed_by_server_is_retried_on_a_fresh_one() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_ok(b"{}"))  # keep-alive advertised, then closed: a keep-alive timeout
        await writer.drain()

    async def main() -> None:
        server, url, conns = await _serve(handler)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=2)
        for _ in range(3):
            resp = await pool.post(url, "/p", b"{}", [])
            assert await resp.read() == b"{}"
            resp.release()
            await asyncio.sleep(0.05)  # the server's FIN arrives while the connection idles
        assert conns[0] == 3
        await pool.close()
        server.close()

    run(main())


def test_connection_refused_and_read_timeout_are_upstream_errors() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    async def main() -> None:
        server, url, _ = await _serve(silent)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=0.2)
        with pytest.raises(UpstreamError, match="read timeout"):
            await pool.post(url, "/p", b"{}", [])
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="connect"):
            await pool.post(url, "/p", b"{}", [])
        await pool.close()

    run(main())


def test_chunked_stream_cut_mid_body_raises_and_close_delimited_body_completes() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n"
        )
        await writer.drain()
        await asyncio.sleep(0.05)

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"a":')
        await writer.drain()
        writer.write(b"1}")
        await writer.drain()

    async def main() -> None:
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=2)
        server, url, _ = await _serve(cut)
        resp = await pool.post(url, "/p", b"{}", [])
        assert await resp.readany() == b"data: "
        with pytest.raises(UpstreamError):
            await resp.readany()
        resp.close()
        server.close()
        server, url, _ = await _serve(until_close)
        resp = await pool.post(url, "/p", b"{}", [])
        assert await resp.read() == b'{"a":1}'
        resp.release()
        await pool.close()
        server.close()

    run(main())


def test_malformed_response_is_an_upstream_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)

    async def main() -> None:
        server, url, _ = await _serve(garbage)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=2)
        with pytest.raises(UpstreamError, match="malformed"):
            await pool.post(url, "/p", b"{}", [])
        await pool.close()
        server.close()

    run(main())


def test_unread_stream_pauses_the_upstream_instead_of_buffering_it_all() -> None:
    sent = [0]
    chunk = b"x" * 65536

    async def firehose(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for _ in range(400):  # 25 MiB offered
            writer.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            await writer.drain()
            sent[0] += len(chunk)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        server, url, _ = await _serve(firehose)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=5)
        resp = await pool.post(url, "/p", b"{}", [])
        await asyncio.sleep(0.5)  # a slow client: nothing read for a while
        # The server is held back by TCP flow control well before 25 MiB.
        assert sent[0] < 12 * 1024 * 1024
        total = 0
        while data := await resp.readany():
            total += len(data)
        assert total == 400 * len(chunk)
        resp.release()
        await pool.close()
        server.close()

    run(main())
