"""TLS between edges: a spilled request (a tenant's key and prompt) crosses regions encrypted.

The edge serves plain HTTP/1.1 and TLS is terminated in front of it (an ingress or sidecar;
docs/security.md); here a small terminator on loopback plays that part, with a certificate of a
private CA (``trustme``). The forwarding edge verifies it with ``--upstream-ca-file``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from regions.supervisor import free_port, wait_http
from tests.integration.test_edge_support import (
    instance,
    route_of,
    spawn_engine,
    start_edge,
    table_doc,
)

TENANTS = [
    {
        "tenant": "any",
        "key_hashes": [hashlib.sha256(b"fi_any").hexdigest()],
        "allowed_regions": ["r1", "r2"],
    }
]


class TlsTerminator:
    """TLS on ``port``, plain TCP to ``backend``: what an ingress does in front of an edge."""

    def __init__(self, context: ssl.SSLContext, backend: int) -> None:
        self.port = free_port()
        self.context = context
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port, ssl=self.context)
        )
        self.ready.set()
        self.loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.backend)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_r2(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Region r2's edge (serving qwen) behind TLS; yields its https URL."""
    tmp = tmp_path_factory.mktemp("tls-r2")
    engine = spawn_engine(tmp, "q2", "--model", "qwen")
    edge = None
    terminator = None
    try:
        wait_http(engine.url + "/health", watch=engine.proc)
        doc = table_doc("r2", 1, [instance(engine, model="qwen")])
        doc["tenants"] = TENANTS
        edge = start_edge(tmp, doc)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        terminator = TlsTerminator(context, edge.port)
        yield f"https://127.0.0.1:{terminator.port}"
    finally:
        if terminator is not None:
            terminator.stop()
        if edge is not None:
            edge.proc.stop()
        engine.proc.stop()


@contextlib.contextmanager
def r1_spilling_to(tmp: Path, remote_url: str, *args: str) -> Iterator[str]:
    """Region r1's edge (no qwen of its own, so qwen spills to r2); yields its URL."""
    local = spawn_engine(tmp, "e1")
    edge = None
    try:
        wait_http(local.url + "/health", watch=local.proc)
        doc = table_doc("r1", 1, [instance(local)])
        doc["tenants"] = TENANTS
        doc["remote_regions"] = [
            {"code": "r2", "edge_url": remote_url, "rtt_ms": 5, "models": ["qwen"],
             "headroom": 0.5}
        ]  # fmt: skip
        edge = start_edge(tmp, doc, *args)
        yield edge.url
    finally:
        if edge is not None:
            edge.proc.stop()
        local.proc.stop()


def ask_qwen(url: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={"model": "qwen", "messages": [{"role": "user", "content": "over tls"}]},
        headers={"Authorization": "Bearer fi_any"},
        timeout=15,
    )


def test_spill_over_to_a_remote_edge_over_verified_tls(
    ca: trustme.CA, tls_r2: str, tmp_path: Path
) -> None:
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    with r1_spilling_to(tmp_path, tls_r2, "--upstream-ca-file", str(bundle)) as url:
        answer = ask_qwen(url)
    assert answer.status_code == 200, answer.text
    route = route_of(answer.headers)
    assert route["region"] == "r2" and route["remote_from"] == "r1"


def test_an_untrusted_remote_certificate_is_refused(tls_r2: str, tmp_path: Path) -> None:
    """Without the private CA the remote edge's certificate does not verify: nothing is sent
    there (the tenant's key and prompt never leave over an unauthenticated channel)."""
    with r1_spilling_to(tmp_path, tls_r2) as url:
        answer = ask_qwen(url)
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "upstream_error"
