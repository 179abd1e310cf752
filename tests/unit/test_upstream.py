"""The edge's upstream HTTP/1.1 client against raw loopback servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trustme

from regions.edge.http.upstream import UpstreamError, UpstreamPool, _Origin, client_ssl_context

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


@pytest.mark.parametrize("read_late", [False, True])
@pytest.mark.parametrize("size", [1024 * 1024, 384 * 1024])
def test_non_streamed_answer_over_the_high_water_mark_is_read_whole_and_reusable(
    size: int, read_late: bool
) -> None:
    body = b"x" * size

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(_ok(body))
            await writer.drain()

    async def main() -> None:
        server, url, conns = await _serve(handler)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=1)
        for _ in range(2):  # the second answer on the same connection: it was left reading
            resp = await pool.post(url, "/p", b"{}", [])
            if read_late:
                await asyncio.sleep(0.1)  # paused at the high-water mark before read() starts
            assert await resp.read() == body
            resp.release()
        assert conns[0] == 1
        await pool.close()
        server.close()

    run(main())


@pytest.mark.parametrize("read_late", [False, True])
def test_answer_over_max_body_bytes_is_refused_and_its_connection_dropped(read_late: bool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(_ok(b"x" * 300_000))
            await writer.drain()

    async def main() -> None:
        server, url, conns = await _serve(handler)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=1, max_body_bytes=100_000)
        resp = await pool.post(url, "/p", b"{}", [])
        if read_late:
            await asyncio.sleep(0.1)  # all of it is in (or paused) before read() starts
        with pytest.raises(UpstreamError, match="answer too large") as caught:
            await resp.read()
        assert caught.value.sent
        resp.release()
        resp = await pool.post(url, "/p", b"{}", [])
        with pytest.raises(UpstreamError, match="answer too large"):
            await resp.read()
        assert conns[0] == 2  # never reused
        await pool.close()
        server.close()

    run(main())


def test_response_head_over_max_head_bytes_is_refused_and_a_large_first_read_is_not() -> None:
    async def endless_header(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-junk: ")
        for _ in range(64):  # 1 MiB of one header value, no CRLF
            writer.write(b"j" * 16384)
            await writer.drain()
        await asyncio.sleep(5)

    big = b"y" * 200_000

    async def big_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(_ok(big, b"x-pad: " + b"p" * 15_000 + b"\r\n"))  # one write
            await writer.drain()

    async def main() -> None:
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=2, max_head_bytes=16384)
        server, url, conns = await _serve(endless_header)
        with pytest.raises(UpstreamError, match="head too large") as caught:
            await pool.post(url, "/p", b"{}", [])
        assert caught.value.sent
        server.close()
        # A head within the limit whose read also carries body bytes past it is fine.
        server, url, conns = await _serve(big_body)
        for _ in range(2):
            resp = await pool.post(url, "/p", b"{}", [])
            assert await resp.read() == big
            resp.release()
        assert conns[0] == 1
        await pool.close()
        server.close()

    run(main())


@pytest.mark.parametrize("surplus_arrives", ["with_the_answer", "while_idle"])
def test_a_second_answer_to_one_request_never_answers_the_next(surplus_arrives: str) -> None:
    stale_head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n"
    served = [0]
    stale_sent = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        served[0] += 1
        if served[0] == 1:
            if surplus_arrives == "with_the_answer":
                writer.write(_ok(b'"first"') + stale_head)
            else:
                writer.write(_ok(b'"first"'))
                await writer.drain()
                await asyncio.sleep(0.02)  # the client has released the connection by now
                writer.write(stale_head)
            await writer.drain()
            stale_sent.set()
            # Were this connection reused, the next request would get the stale answer.
            await _read_request(reader)
            writer.write(b'\r\n"stale"' + _ok(b'"late"'))
            await writer.drain()
            return
        while True:
            writer.write(_ok(b'"second"'))
            await writer.drain()
            await _read_request(reader)

    async def main() -> None:
        server, url, conns = await _serve(handler)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=1)
        resp = await pool.post(url, "/p", b"{}", [])
        assert await resp.read() == b'"first"'
        resp.release()
        await stale_sent.wait()
        await asyncio.sleep(0.05)  # loopback delivery
        resp = await pool.post(url, "/p", b"{}", [])
        assert await resp.read() == b'"second"'
        resp.release()
        assert conns[0] == 2
        await pool.close()
        server.close()

    run(main())


def test_read_timeout_on_a_reused_connection_is_not_resent() -> None:
    requests = [0]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        requests[0] += 1
        writer.write(_ok(b"{}"))
        await writer.drain()
        await _read_request(reader)
        requests[0] += 1
        await asyncio.sleep(5)  # the engine is busy with it

    async def main() -> None:
        server, url, conns = await _serve(handler)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=0.2)
        resp = await pool.post(url, "/p", b"{}", [])
        await resp.read()
        resp.release()
        with pytest.raises(UpstreamError, match="read timeout") as caught:
            await pool.post(url, "/p", b"{}", [])
        assert caught.value.sent
        await asyncio.sleep(0.05)
        assert requests[0] == 2 and conns[0] == 1
        await pool.close()
        server.close()

    run(main())


@pytest.mark.parametrize("ending", ["eof", "reset"])
def test_reused_connection_dropped_by_the_peer_before_answering_is_resent(ending: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_ok(b'"one"'))
        await writer.drain()
        if not await reader.read(1):  # the next request's first byte: it is reused
            return
        if ending == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        # else: closed (EOF) by _serve, without an answer

    async def main() -> None:
        server, url, conns = await _serve(handler)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=1)
        for _ in range(2):
            resp = await pool.post(url, "/p", b"{}", [])
            assert await resp.read() == b'"one"'
            resp.release()
        assert conns[0] == 2
        await pool.close()
        server.close()

    run(main())


def test_upstream_error_says_whether_the_request_may_have_reached_the_upstream() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def main() -> None:
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=1)
        server, url, _ = await _serve(reset)
        with pytest.raises(UpstreamError) as caught:  # a fresh connection is never resent
            await pool.post(url, "/p", b"{}", [])
        assert caught.value.sent
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="connect") as caught:
            await pool.post(url, "/p", b"{}", [])
        assert not caught.value.sent
        await pool.close()

    run(main())


def test_a_server_that_answers_before_the_request_is_a_connect_failure() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_ok(b"{}"))
        await writer.drain()

    async def main() -> None:
        server, url, _ = await _serve(handler)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=1)
        for _ in range(3):
            with pytest.raises(UpstreamError, match="closed by the server") as caught:
                await pool.post(url, "/p", b"{}", [])
            assert not caught.value.sent
        await pool.close()
        server.close()

    run(main())


def test_host_header_has_the_port_only_when_not_the_default_and_https_means_tls() -> None:
    async def main() -> None:
        ctx = client_ssl_context(None)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=1, ssl_context=ctx)
        for base, host, tls in [
            ("http://engine", b"engine", False),
            ("http://engine:80", b"engine", False),
            ("http://engine:8000", b"engine:8000", False),
            ("https://edge.example", b"edge.example", True),
            ("HTTPS://edge.example:443", b"edge.example", True),
            ("https://edge.example:8443", b"edge.example:8443", True),
            ("http://[::1]:8000", b"[::1]:8000", False),
        ]:
            origin = _Origin(base, pool)
            assert origin.authority == host, base
            assert origin.ssl is (ctx if tls else None), base
        await pool.close()

    run(main())


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


async def _serve_tls(
    ca: trustme.CA, handler: Handler, identity: str = "127.0.0.1"
) -> tuple[asyncio.Server, str, list[int]]:
    """``_serve`` over TLS, with a certificate from ``ca`` for ``identity``."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(identity).configure_cert(server_ctx)
    conns = [0]

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns[0] += 1
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    return server, f"https://127.0.0.1:{port}", conns


def test_https_upstream_with_a_trusted_ca(ca: trustme.CA, tmp_path: Path) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await _read_request(reader))
            writer.write(_ok(b'{"tls":true}'))
            await writer.drain()

    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))

    async def main() -> None:
        server, url, conns = await _serve_tls(ca, handler)
        pool = UpstreamPool(
            connect_timeout_s=1, read_timeout_s=2, ssl_context=client_ssl_context(str(ca_file))
        )
        for _ in range(2):
            resp = await pool.post(url, "/p", b"{}", [])
            assert resp.status == 200 and await resp.read() == b'{"tls":true}'
            resp.release()
        assert conns[0] == 1
        assert f"\r\nhost: {url.removeprefix('https://')}\r\n".encode() in seen[0]
        await pool.close()
        server.close()

    run(main())


@pytest.mark.parametrize("trust", ["system", "another_ca", "for_another_host"])
def test_https_upstream_with_an_untrusted_certificate_is_a_connect_failure(
    ca: trustme.CA, trust: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_ok(b"{}"))
        await writer.drain()

    async def main() -> None:
        identity = "edge.example" if trust == "for_another_host" else "127.0.0.1"
        server, url, _ = await _serve_tls(ca, handler, identity)
        ctx = None
        if trust != "system":
            ctx = ssl.create_default_context()
            (ca if trust == "for_another_host" else trustme.CA()).configure_trust(ctx)
        pool = UpstreamPool(connect_timeout_s=1, read_timeout_s=2, ssl_context=ctx)
        with pytest.raises(UpstreamError, match="connect") as caught:
            await pool.post(url, "/p", b"{}", [])
        assert not caught.value.sent
        await pool.close()
        server.close()

    run(main())
