"""Live load shared by a region's edges (``regions/edge/peer_load.py``): what another edge
publishes is counted here as if this edge had sent it, without drift or double counting."""

from __future__ import annotations

import orjson

from regions.edge.load import LoadBoard
from regions.edge.peer_load import EXPIRE_S, MAX_MESSAGE_BYTES, PeerLoads, decode, encode
from regions.engines.metrics import EngineLoad

RATE = 1000.0  # prefill tokens/s


def board_of(*ids: str) -> LoadBoard:
    board = LoadBoard()
    board.sync(list(ids))
    return board


def peers_of(board: LoadBoard, freed: list[str] | None = None) -> PeerLoads:
    sink = freed if freed is not None else []
    return PeerLoads(board, "me", lambda _inst: RATE, sink.append)


def scraped(board: LoadBoard, inst: str, running: int, now: float) -> None:
    board.loads[inst].scraped(EngineLoad(running, 0, 0.1), now)


def test_what_a_peer_sent_since_the_scrape_counts_here_at_once() -> None:
    board = board_of("i-1", "i-2")
    peers = peers_of(board)
    scraped(board, "i-1", 2, 0.0)
    peers.apply("b", {"i-1": (10, 8, 5000, 2)}, 0.1)  # first report: the baseline
    assert board.loads["i-1"].snapshot()[0] == 2  # its 2 in flight are the scrape's 2
    peers.apply("b", {"i-1": (13, 8, 5600, 5)}, 0.2)  # three more sent since
    outstanding, _, _ = board.loads["i-1"].snapshot()
    assert outstanding == 5
    assert board.loads["i-1"].peer_inflight == 5
    # Their uncached prompt tokens are prefill work ahead of the next request.
    assert board.loads["i-1"].pending(0.2, RATE) == 600
    assert board.loads["i-2"].snapshot()[0] == 0


def test_a_lost_message_loses_nothing_the_next_one_carries_the_difference() -> None:
    board = board_of("i-1")
    peers = peers_of(board)
    scraped(board, "i-1", 0, 0.0)
    peers.apply("b", {"i-1": (0, 0, 0, 0)}, 0.1)
    # (1, 0, 100, 1) was lost on the way; the next report still counts both requests.
    peers.apply("b", {"i-1": (2, 0, 300, 2)}, 0.2)
    assert board.loads["i-1"].snapshot()[0] == 2


def test_peers_in_flight_is_replaced_not_added_and_a_freed_slot_wakes_a_waiter() -> None:
    board = board_of("i-1")
    freed: list[str] = []
    peers = peers_of(board, freed)
    peers.apply("b", {"i-1": (4, 0, 0, 4)}, 0.0)
    peers.apply("b", {"i-1": (4, 0, 0, 4)}, 0.1)  # a heartbeat repeats the same counts
    peers.apply("c", {"i-1": (1, 0, 0, 1)}, 0.1)
    assert board.loads["i-1"].peer_inflight == 5
    peers.apply("b", {"i-1": (4, 2, 0, 2)}, 0.2)
    assert board.loads["i-1"].peer_inflight == 3
    assert freed == ["i-1", "i-1"]


def test_a_silent_peer_stops_counting_and_its_slots_are_freed() -> None:
    board = board_of("i-1")
    freed: list[str] = []
    peers = peers_of(board, freed)
    peers.apply("b", {"i-1": (3, 0, 0, 3)}, 0.0)
    assert peers.expire(EXPIRE_S) == 1  # not yet silent long enough
    assert peers.expire(EXPIRE_S + 0.01) == 0
    assert board.loads["i-1"].peer_inflight == 0
    assert freed == ["i-1"] * 3


def test_a_restarted_peer_sets_a_new_baseline_instead_of_taking_requests_back() -> None:
    board = board_of("i-1")
    peers = peers_of(board)
    scraped(board, "i-1", 0, 0.0)
    peers.apply("b", {"i-1": (50, 49, 9000, 1)}, 0.1)
    peers.apply("b", {"i-1": (1, 0, 100, 1)}, 0.2)  # same id, totals from zero again
    load = board.loads["i-1"]
    assert (load.admitted_since_scrape, load.finished_since_scrape) == (0, 0)
    peers.apply("b", {"i-1": (2, 0, 200, 2)}, 0.3)
    assert load.snapshot()[0] == 2


def test_own_messages_and_unknown_instances_change_nothing() -> None:
    board = board_of("i-1")
    peers = peers_of(board)
    peers.apply("me", {"i-1": (5, 0, 0, 5)}, 0.0)
    peers.apply("b", {"i-9": (5, 0, 0, 5)}, 0.0)
    peers.apply("b", {"i-9": (9, 0, 0, 9)}, 0.1)
    assert board.loads["i-1"].peer_inflight == 0
    assert "i-9" not in board.loads


def test_the_pending_prefill_is_cleared_once_nothing_sent_anywhere_is_in_flight() -> None:
    board = board_of("i-1")
    peers = peers_of(board)
    peers.apply("b", {"i-1": (0, 0, 0, 0)}, 0.0)
    peers.apply("b", {"i-1": (1, 0, 4000, 1)}, 0.0)
    load = board.loads["i-1"]
    load.admit(1000)
    load.finish(0.5)  # this edge's request ended, the peer's has not
    assert load.pending(0.0, RATE) == 5000
    peers.apply("b", {"i-1": (1, 1, 4000, 0)}, 0.1)
    assert load.pending(0.1, RATE) == 0


def test_an_edge_publishes_its_totals_and_in_flight_per_instance() -> None:
    board = board_of("i-1", "i-2")
    board.loads["i-1"].admit(700)
    board.loads["i-1"].admit(50)
    board.loads["i-1"].finish(1.0)
    peer, counts = decode(encode("edge-a@h:1", board)) or ("", {})
    assert peer == "edge-a@h:1"
    assert counts == {"i-1": (2, 1, 750, 1)}  # i-2 never sent to: left out


def test_malformed_or_oversized_messages_are_refused() -> None:
    good = {"p": "b", "i": {"i-1": [1, 0, 10, 1]}}
    assert decode(orjson.dumps(good)) == ("b", {"i-1": (1, 0, 10, 1)})
    for bad in (
        b"not json",
        b"[]",
        orjson.dumps({"p": "", "i": {}}),
        orjson.dumps({"p": "b", "i": {"i-1": [1, 0, 10]}}),
        orjson.dumps({"p": "b", "i": {"i-1": [1, -1, 10, 1]}}),
        orjson.dumps({"p": "b", "i": {"i-1": [1, 0, 1.5, 1]}}),
        orjson.dumps({"p": "b", "i": {"i-1": [True, 0, 1, 1]}}),
        b'{"p":"b","i":{}}' + b" " * MAX_MESSAGE_BYTES,
    ):
        assert decode(bad) is None, bad[:60]
