"""Session keys: fixed-size, per tenant and model, and a map no client can grow past its bound."""

from __future__ import annotations

from regions.edge.app import Edge
from regions.edge.config import EdgeConfig
from regions.edge.policy.sessions import SessionMap, home, session_key
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


def test_remembering_says_when_a_session_is_news_for_the_other_edges() -> None:
    sessions = SessionMap(10)
    key = session_key("t", "llama", b"chat-1")
    assert sessions.remember(key, "i-1")  # new here
    assert not sessions.remember(key, "i-1")  # its next turn, same instance: nothing to tell
    assert sessions.remember(key, "i-2")  # moved
    assert sessions.get(key) == "i-2"


def test_a_sessions_home_is_the_same_at_every_edge_and_moves_only_with_its_instance() -> None:
    instances = [f"i-{n}" for n in range(8)]
    keys = [session_key("t", "llama", b"s%d" % n) for n in range(4000)]
    homes = {k: home(k, instances) for k in keys}
    # Any order of the table's instances (another edge, another table version): the same home.
    assert all(home(k, list(reversed(instances))) == homes[k] for k in keys)
    # Spread: every instance is home to about an eighth of the sessions.
    counts = {i: sum(1 for h in homes.values() if h == i) for i in instances}
    assert all(350 < c < 650 for c in counts.values()), counts
    # Removing one instance moves its sessions only.
    rest = instances[:3] + instances[4:]
    moved = [k for k in keys if home(k, rest) != homes[k]]
    assert moved and all(homes[k] == "i-3" for k in moved)
    assert home(keys[0], []) is None
