"""Session keys: fixed-size, per tenant and model, and a map no client can grow past its bound."""

from __future__ import annotations

from regions.edge.app import Edge
from regions.edge.config import EdgeConfig
from regions.edge.sessions import session_key
from regions.tables.schema import Instance, RoutingTable


def test_session_keys_are_fixed_size_and_scoped_to_tenant_and_model() -> None:
    key = session_key("acme", "llama", b"chat-42")
    assert isinstance(key, int) and 0 <= key < 2**64
    assert key == session_key("acme", "llama", b"chat-42")
    assert key != session_key("other", "llama", b"chat-42")  # another tenant's same id
    assert key != session_key("acme", "qwen", b"chat-42")


def test_the_session_map_keeps_at_most_its_capacity() -> None:
    table = RoutingTable(
        schema_version=1,
        version=1,
        region="r1",
        generated_at="2026-11-30T00:00:00Z",
        instances=(Instance(id="i-1", url="http://127.0.0.1:9", model="llama"),),
    )
    edge = Edge(EdgeConfig(region="r1", table_path=None, session_capacity=100), table)
    for n in range(10_000):
        edge.sessions.remember(session_key("t", "llama", b"%d" % n), "i-1")
    assert len(edge.sessions) == 100
    assert session_key("t", "llama", b"9999") in edge.sessions  # the most recent stay
