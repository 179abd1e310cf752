"""Request bodies over the limit get a 413 from ``fedinfer serve`` before they are read.

Django's ASGI handler reads a whole body before its middleware runs, so these tests talk to a
real ``fedinfer serve`` (uvicorn) process over a raw socket: a declared length over the limit
is refused before any body byte is sent, and a chunked body is refused while it still streams.
"""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.conf import settings

from regions.supervisor import Supervisor
from tests.integration.control_plane_support import serve, subprocess_env

MiB = 1024 * 1024
URL = "/api/v1/auth/token/"  # open to anyone: nothing but the body limit stands in the way


@dataclass
class Server:
    port: int
    pid: int

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


@pytest.fixture
def server(db: None, procs: Supervisor) -> Server:
    url, proc = serve(procs, subprocess_env(settings.REDIS_URL))
    return Server(int(url.rsplit(":", 1)[1]), proc.pid)


def connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    # Small kernel buffers, so what was "sent" is close to what the server took in.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    return sock


def read_response(sock: socket.socket, first: bytes = b"", timeout: float = 5.0) -> bytes:
    """Whatever the server answers until it closes the connection (or ``timeout``)."""
    data = first
    sock.settimeout(timeout)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def head(extra: str) -> bytes:
    return (
        f"POST {URL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}\r\n"
    ).encode()


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(
    server: Server,
) -> None:
    with connect(server) as sock:
        sock.sendall(head(f"Content-Length: {50 * MiB}\r\n"))
        started = time.monotonic()
        response = read_response(sock)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert time.monotonic() - started < 4
    assert b'"code":"payload_too_large"' in response
    assert f"{50 * MiB} bytes".encode() in response


def test_a_chunked_body_is_refused_as_soon_as_it_goes_over_the_limit(server: Server) -> None:
    total, chunk = 50 * MiB, 64 * 1024
    frame = b"%x\r\n" % chunk + b"x" * chunk + b"\r\n"
    rss_before = server.rss_bytes()
    sent, first = 0, b""
    with connect(server) as sock:
        sock.sendall(head("Transfer-Encoding: chunked\r\n"))
        while sent < total:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                first = sock.recv(65536)
                break
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += chunk
            time.sleep(0.003)  # a slow client: the server is never behind
        response = read_response(sock, first)
    assert response.startswith(b"HTTP/1.1 413"), (sent, response[:200])
    assert b'"code":"payload_too_large"' in response
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    print(f"413 after {sent / MiB:.1f} MiB sent of {total / MiB:.0f} (limit {limit / MiB:.0f} MiB)")
    assert limit < sent < 8 * MiB
    assert server.rss_bytes() - rss_before < 16 * MiB


def test_bodies_within_the_limit_still_reach_django_chunked_or_not(server: Server) -> None:
    body = b'{"username": "nobody", "password": "x", "padding": "' + b"p" * (900 * 1024) + b'"}'
    with connect(server) as sock:
        sock.sendall(head(f"Content-Length: {len(body)}\r\nConnection: close\r\n") + body)
        response = read_response(sock)
    # DRF parsed the whole body (to its closing brace) and refused the unknown field.
    assert response.startswith(b"HTTP/1.1 400"), response[:300]
    assert response.endswith(b'{"padding":["Unknown field."]}'), response[-300:]

    chunked = b"".join(
        b"%x\r\n" % len(part) + part + b"\r\n"
        for part in (body[i : i + 10_000] for i in range(0, len(body), 10_000))
    )
    with connect(server) as sock:
        sock.sendall(head("Transfer-Encoding: chunked\r\nConnection: close\r\n"))
        sock.sendall(chunked + b"0\r\n\r\n")
        response = read_response(sock)
    # Through to the view (DRF reads no body without a Content-Length: fields are missing).
    assert response.startswith(b"HTTP/1.1 400"), response[:300]
    assert b"This field is required." in response
