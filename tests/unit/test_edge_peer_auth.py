"""Peer sync holds against whoever can publish on the region's channel (``peer_auth.py``,
``peer_load.py``, ``peer_sync.py``): unsigned, stale, replayed or foreign messages are refused
and counted before their JSON is read; a signed report is bounded by the table (its instances,
their slots); the peers counted are bounded; a silent peer frees its slots in bounded work."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry

from regions.edge.cli import config_from_args
from regions.edge.flags import build_parser
from regions.edge.policy.peer_auth import MAX_AGE_MS, MAX_SKEW_MS, open_sealed, peer_keys, seal
from regions.edge.view.load import LoadBoard
from regions.edge.view.peer_load import (
    EXPIRE_S,
    MAX_PEERS,
    SEQ_MEMORY_S,
    Chain,
    Counts,
    PeerLoads,
    Placed,
    Reading,
    encode,
)
from regions.edge.view.peer_sync import PeerSync
from regions.engines.metrics import EngineLoad

RING = {"k1": "peer-secret"}
KEYS = peer_keys(RING, "r1")
CAP = 8
NOW_MS = 1_800_000_000_000


class Clock:
    """The receiving edge's wall clock (unix ms), set by the test."""

    def __init__(self) -> None:
        self.ms = NOW_MS

    def __call__(self) -> int:
        return self.ms


class Edge:
    """One edge's peer sync over a table of ``i-1`` and ``i-2`` (:data:`CAP` slots each),
    with what it did on the peers' word."""

    def __init__(self, keys: Mapping[str, bytes] = KEYS) -> None:
        self.board = LoadBoard()
        self.board.sync({"i-1": "m", "i-2": "m"})
        self.freed: list[tuple[str, int]] = []
        self.chains: list[tuple[str, Sequence[int]]] = []
        self.sessions: list[tuple[int, str]] = []
        self.clock = Clock()
        peers = PeerLoads(
            self.board,
            "me@h:1:aaaaaa",
            lambda _inst: 1000.0,
            lambda inst, n: self.freed.append((inst, n)),
            lambda inst: CAP if inst in ("i-1", "i-2") else None,
        )
        self.sync = PeerSync(
            "redis://unused",
            "r1",
            peers,
            CollectorRegistry(),
            keys=keys,
            clock_ms=self.clock,
            placed=self,
        )

    @property
    def peers(self) -> PeerLoads:
        return self.sync.peers

    def chain(self, instance: str, hashes: Sequence[int]) -> None:
        """Where the peers' prompts go (``PeerPlacements``)."""
        self.chains.append((instance, hashes))

    def session(self, key: int, instance: str) -> None:
        self.sessions.append((key, instance))

    def receive(self, message: bytes) -> None:
        self.sync._receive(message)

    def count(self, result: str) -> float:
        return self.sync.messages.labels(result)._value.get()


def report(
    peer: str,
    counts: Mapping[str, Counts],
    *,
    chains: Sequence[Chain] = (),
    sessions: Sequence[Placed] = (),
    readings: Mapping[str, Reading] | None = None,
) -> bytes:
    """A report of changes (``peer_load.encode``)."""
    return encode(peer, counts, None, chains, sessions, readings)


def sealed(
    peer: str, seq: int, body: bytes, at_ms: int = NOW_MS, keys: Mapping[str, bytes] = KEYS
) -> bytes:
    return seal(keys, peer, seq, at_ms, body)


# ---------------------------------------------------------------- signatures and freshness


def test_a_report_opens_with_any_key_of_the_ring_and_only_in_its_region() -> None:
    body = report("b", {"i-1": (1, 0, 0, 1)})
    old = peer_keys({"k1": "old"}, "r1")
    rotated = peer_keys({"k2": "new", "k1": "old"}, "r1")
    assert list(rotated) == ["k2", "k1"]
    # An edge not rotated yet is heard by one that is, and one that is signs with the new key.
    opened = open_sealed(sealed("b", 1, body, keys=old), rotated, NOW_MS)
    assert not isinstance(opened, str) and bytes(opened.body) == body
    assert (opened.peer, opened.seq) == ("b", 1)
    assert open_sealed(sealed("b", 2, body, keys=rotated), old, NOW_MS) == "unknown_key"
    # The same ring derives another key in another region: a report does not cross over.
    other_region = peer_keys({"k1": "old"}, "r2")
    assert open_sealed(sealed("b", 1, body, keys=other_region), old, NOW_MS) == "bad_signature"
    with pytest.raises(ValueError, match="key id"):
        peer_keys({"k 1": "x"}, "r1")


def test_unsigned_tampered_foreign_stale_and_future_messages_are_refused() -> None:
    body = report("b", {"i-1": (1, 0, 0, 1)})
    good = sealed("b", 1, body)
    assert not isinstance(open_sealed(good, KEYS, NOW_MS), str)
    tampered = good.replace(b"[1,0,0,1]", b"[9,0,0,9]")
    assert open_sealed(tampered, KEYS, NOW_MS) == "bad_signature"
    wrong_key = sealed("b", 1, body, keys=peer_keys({"k1": "guessed"}, "r1"))
    assert open_sealed(wrong_key, KEYS, NOW_MS) == "bad_signature"
    assert open_sealed(body, KEYS, NOW_MS) == "unsigned"
    assert open_sealed(sealed("b", 1, body, NOW_MS - MAX_AGE_MS - 1), KEYS, NOW_MS) == "stale"
    assert open_sealed(sealed("b", 1, body, NOW_MS + MAX_SKEW_MS + 1), KEYS, NOW_MS) == "stale"
    assert not isinstance(open_sealed(sealed("b", 1, body, NOW_MS - 1000), KEYS, NOW_MS), str)
    for bad in (
        b"fp1 k1 b 1\n" + body + b"0" * 64,  # a field short
        b"fp1 k1 b 1 " + str(NOW_MS).encode() + b" x\n" + body + b"0" * 64,
        b"fp1 k1 b -1 " + str(NOW_MS).encode() + b"\n" + body + b"0" * 64,
        b"fp1 " + b"k" * 300 + b"\n" + body,  # no header within its bound
        sealed("b" * 129, 1, body),  # peer ids: bounded in length ...
        sealed("b/../x", 1, body),  # ... and charset
        b"fp1 k1 b 1 1\n",
    ):
        assert open_sealed(bad, KEYS, NOW_MS) == "malformed", bad[:40]


def test_an_unsigned_forged_report_is_dropped_and_counted() -> None:
    edge = Edge()
    forged = orjson.dumps({"p": "evil", "i": {"i-1": [2**64 - 1] * 4}})
    edge.receive(forged)
    edge.receive(sealed("evil", 1, forged, keys=peer_keys({"k1": "guessed"}, "r1")))
    assert edge.peers.peers == {}
    assert edge.board.loads["i-1"].peer_inflight == 0
    assert (edge.count("unsigned"), edge.count("bad_signature")) == (1, 1)


def test_a_stale_or_replayed_message_is_dropped_and_cannot_count_twice() -> None:
    edge = Edge()
    load = edge.board.loads["i-1"]
    load.scraped(EngineLoad(0, 0, 0.0), 0.0)
    first = sealed("b", 1, report("b", {"i-1": (10, 0, 0, 2)}))
    edge.receive(first)  # the baseline
    edge.receive(sealed("b", 2, report("b", {"i-1": (20, 0, 0, 2)})))
    assert load.admitted_since_scrape == 10
    # An older report again would read as a restart (totals down, a new baseline) and the next
    # one would count its ten requests a second time: refused by its sequence number.
    edge.receive(first)
    edge.receive(sealed("b", 2, report("b", {"i-1": (20, 0, 0, 2)})))
    assert edge.count("replayed") == 2
    edge.receive(sealed("b", 3, report("b", {"i-1": (22, 0, 0, 2)})))
    assert load.admitted_since_scrape == 12
    edge.receive(sealed("b", 4, report("b", {}), NOW_MS - MAX_AGE_MS - 1))
    assert edge.count("stale") == 1
    # Silent, expired: its last message still cannot bring it back while it could be fresh.
    assert edge.peers.expire(time.monotonic() + EXPIRE_S + 0.1) == 0
    edge.receive(sealed("b", 3, report("b", {"i-1": (22, 0, 0, 8)})))
    assert edge.peers.peers == {} and edge.count("replayed") == 3
    # Long after, a message that old would be stale anyway: its sequence number is forgotten.
    edge.peers.expire(time.monotonic() + SEQ_MEMORY_S + 1)
    assert edge.peers._seqs == {}


# ---------------------------------------------------------------- bounds of a signed report


def test_a_signed_report_of_absurd_counts_is_clamped_and_its_silence_frees_in_bounded_time() -> (
    None
):
    edge = Edge()
    edge.receive(sealed("b", 1, report("b", {"i-1": (0, 0, 0, 0)})))
    edge.receive(sealed("b", 2, report("b", {"i-1": (2**63 - 1, 0, 2**63 - 1, 2**63 - 1)})))
    load = edge.board.loads["i-1"]
    assert load.peer_inflight == CAP  # its slots, not 2**63
    assert load.admitted_since_scrape == 64 * CAP  # what a report may add
    assert edge.count("clamped") == 1
    edge.receive(sealed("b", 3, report("b", {"i-1": (2**64 - 1, 0, 0, 2**64 - 1)})))
    assert edge.count("malformed") == 1  # past any 63-bit counter: refused whole
    started = time.perf_counter()
    assert edge.peers.expire(time.monotonic() + EXPIRE_S + 0.1) == 0
    assert time.perf_counter() - started < 0.05
    assert edge.freed == [("i-1", CAP)]  # one call, however many slots
    assert load.peer_inflight == 0


def test_an_in_flight_count_of_ten_million_is_freed_in_one_call() -> None:
    """Without the clamp (a table with that many slots), still one call, not one per slot."""
    board = LoadBoard()
    board.sync({"i-1": "m"})
    freed: list[tuple[str, int]] = []
    peers = PeerLoads(
        board, "me", lambda _i: 1.0, lambda i, n: freed.append((i, n)), lambda _i: 10**7
    )
    peers.apply("b", {"i-1": (0, 0, 0, 10**7)}, 0.0)
    peers.expire(EXPIRE_S + 1)
    assert freed == [("i-1", 10**7)]


def test_a_flood_of_fake_peers_leaves_the_peer_table_at_its_cap() -> None:
    edge = Edge()
    for k in range(3000):
        edge.receive(orjson.dumps({"p": f"fake-{k}", "i": {"i-1": [1, 0, 0, 1]}}))
    assert edge.peers.peers == {} and edge.count("unsigned") == 3000
    # Even signed (a key holder gone wrong), the peers counted stay bounded.
    for k in range(3000):
        edge.receive(sealed(f"fake-{k}", 1, report(f"fake-{k}", {"i-1": (1, 0, 0, 1)})))
    assert len(edge.peers.peers) == MAX_PEERS
    assert edge.count("too_many_peers") == 3000 - MAX_PEERS
    assert edge.board.loads["i-1"].peer_inflight == MAX_PEERS


def test_a_report_naming_instances_not_in_the_table_changes_nothing() -> None:
    edge = Edge()
    ghost = report(
        "b",
        {"i-9": (5, 0, 100, 5)},
        chains=[("i-9", [1, 2, 3])],
        sessions=[(7, "i-9")],
        readings={"i-9": (3, 3, 0.5)},
    )
    edge.receive(sealed("b", 1, ghost))
    edge.receive(sealed("b", 2, ghost.replace(b"[5,0,100,5]", b"[9,0,200,9]")))
    assert edge.count("applied") == 2
    assert edge.chains == [] and edge.sessions == []
    assert edge.peers.peers["b"].counts == {}  # nothing kept of it
    assert "i-9" not in edge.board.loads
    assert all(load.peer_inflight == 0 for load in edge.board.loads.values())
    assert edge.sync.readings.labels("peer")._value.get() == 0
    real = report("b", {}, chains=[("i-1", [1])], sessions=[(7, "i-1")])
    edge.receive(sealed("b", 3, real))
    assert edge.chains == [("i-1", [1])] and edge.sessions == [(7, "i-1")]


def test_a_hostile_message_costs_microseconds() -> None:
    edge = Edge()
    body = report("evil", {f"i-{k}": (2**63 - 1, 0, 0, 2**63 - 1) for k in range(200)})
    hostile = [
        body,  # unsigned
        sealed("evil", 1, body, keys=peer_keys({"k1": "guessed"}, "r1")),  # bad signature
        sealed("evil", 1, body, NOW_MS - 60_000),  # stale
        b"fp1 k9 evil 1 1\n" + body,  # unknown key
        b"\xff" * 4096,
    ]
    rounds = 2000
    started = time.perf_counter()
    for _ in range(rounds):
        for message in hostile:
            edge.receive(message)
    per_message = (time.perf_counter() - started) / (rounds * len(hostile))
    assert edge.peers.peers == {}
    assert per_message < 100e-6, f"{per_message * 1e6:.1f} µs a message"


# ---------------------------------------------------------------- where the keys come from


def test_peer_sync_needs_a_key_ring_and_never_takes_it_on_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FEDINFER_PEER_KEYS", raising=False)
    table = tmp_path / "t.json"
    args = ["--region", "r1", "--table", str(table), "--peer-redis-url", "redis://x"]
    with pytest.raises(ValueError, match="--peer-redis-url needs a key ring"):
        config_from_args(build_parser().parse_args(args))
    ring = tmp_path / "peer-keys"
    ring.write_text("k2=new\nk1=old\n")
    cfg = config_from_args(build_parser().parse_args([*args, "--peer-keys-file", str(ring)]))
    assert cfg.peer_keys == peer_keys({"k2": "new", "k1": "old"}, "r1")
    monkeypatch.setenv("FEDINFER_PEER_KEYS", "k1=from-env")
    assert config_from_args(build_parser().parse_args(args)).peer_keys == peer_keys(
        {"k1": "from-env"}, "r1"
    )
    with pytest.raises(SystemExit):  # no abbreviation: a secret is never taken for a path
        build_parser().parse_args([*args, "--peer-keys", "k1=secret"])


def test_in_control_plane_mode_the_peer_keys_derive_from_the_table_key_ring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FEDINFER_PEER_KEYS", raising=False)
    credential = tmp_path / "credential"
    credential.write_text("fe_secret")
    monkeypatch.setenv("FEDINFER_TABLE_KEYS", "t2=table-new,t1=table-old")
    opts = build_parser().parse_args(
        ["--region", "r1", "--control-plane", "http://cp", "--credential-file", str(credential),
         "--peer-redis-url", "redis://x"]
    )  # fmt: skip
    keys = config_from_args(opts).peer_keys
    assert keys == peer_keys({"t2": "table-new", "t1": "table-old"}, "r1")
    assert keys["t2"] != b"table-new"  # derived, never the table key itself
