"""Live load shared by a region's edges (``regions/edge/view/peer_load.py``): what another edge
publishes is counted here as if this edge had sent it, without drift or double counting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson
import pytest
from prometheus_client import CollectorRegistry

from regions.edge.policy.admission import Admission
from regions.edge.policy.peer_auth import peer_keys, seal
from regions.edge.view.load import LoadBoard
from regions.edge.view.peer_load import (
    EXPIRE_S,
    MAX_CHAIN_BLOCKS,
    MAX_CHAINS,
    MAX_DEMANDS,
    MAX_MESSAGE_BYTES,
    MAX_READINGS,
    MAX_REPORT_BLOCKS,
    MAX_REPORT_INSTANCES,
    MAX_SESSIONS,
    MAX_TOTAL,
    SHARE_FLOOR,
    DemandMeter,
    PeerLoads,
    board_counts,
    busiest,
    decode,
    demand_shares,
    encode,
    step_shares,
)
from regions.edge.view.peer_sync import PeerSync
from regions.engines.metrics import EngineLoad
from regions.tables.schema import RoutingTable, decode_table

RATE = 1000.0  # prefill tokens/s


def board_of(*ids: str) -> LoadBoard:
    board = LoadBoard()
    board.sync(dict.fromkeys(ids, "m"))
    return board


#: Every instance's max_concurrency in these tests' table.
CAP = 64
#: The region's peer keys (``peer_auth.py``).
KEYS = peer_keys({"k1": "peer-secret"}, "r1")


def capacity_in(board: LoadBoard) -> Callable[[str], int | None]:
    """The table's instances are the board's, each with :data:`CAP` slots."""
    return lambda inst: CAP if inst in board.loads else None


def peers_of(board: LoadBoard, freed: list[tuple[str, int]] | None = None) -> PeerLoads:
    sink = freed if freed is not None else []
    return PeerLoads(
        board, "me", lambda _inst: RATE, lambda inst, n: sink.append((inst, n)), capacity_in(board)
    )


def sync_of(board: LoadBoard) -> PeerSync:
    return PeerSync("redis://unused", "r1", peers_of(board), CollectorRegistry(), keys=KEYS)


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
    freed: list[tuple[str, int]] = []
    peers = peers_of(board, freed)
    peers.apply("b", {"i-1": (4, 0, 0, 4)}, 0.0)
    peers.apply("b", {"i-1": (4, 0, 0, 4)}, 0.1)  # a heartbeat repeats the same counts
    peers.apply("c", {"i-1": (1, 0, 0, 1)}, 0.1)
    assert board.loads["i-1"].peer_inflight == 5
    peers.apply("b", {"i-1": (4, 2, 0, 2)}, 0.2)
    assert board.loads["i-1"].peer_inflight == 3
    assert freed == [("i-1", 2)]


def test_a_silent_peer_stops_counting_and_its_slots_are_freed() -> None:
    board = board_of("i-1")
    freed: list[tuple[str, int]] = []
    peers = peers_of(board, freed)
    peers.apply("b", {"i-1": (3, 0, 0, 3)}, 0.0)
    assert peers.expire(EXPIRE_S) == 1  # not yet silent long enough
    assert peers.expire(EXPIRE_S + 0.01) == 0
    assert board.loads["i-1"].peer_inflight == 0
    assert freed == [("i-1", 3)]


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
    counts = board_counts(board)
    assert counts == {"i-1": (2, 1, 750, 1)}  # i-2 never sent to: left out
    report = decode(encode("edge-a@h:1", counts, {"acme": 2.5}))
    assert report == ("edge-a@h:1", counts, {"acme": 2.5}, [], [], {})
    # A report of changes only carries no demand: the last full report's stands.
    assert decode(encode("edge-a@h:1", counts)) == ("edge-a@h:1", counts, None, [], [], {})


def test_a_report_of_changes_updates_those_instances_a_full_one_replaces_all() -> None:
    board = board_of("i-1", "i-2")
    peers = peers_of(board)
    peers.apply("b", {"i-1": (2, 0, 0, 2), "i-2": (1, 0, 0, 1)}, 0.0, {"acme": 1.0})
    peers.apply("b", {"i-1": (3, 0, 0, 3)}, 0.01)  # changes only: i-2 stands
    assert (board.loads["i-1"].peer_inflight, board.loads["i-2"].peer_inflight) == (3, 1)
    assert peers.peers["b"].demand == {"acme": 1.0}
    peers.apply("b", {"i-1": (3, 0, 0, 3)}, 0.25, {})  # full: b sends nothing to i-2 now
    assert (board.loads["i-1"].peer_inflight, board.loads["i-2"].peer_inflight) == (3, 0)
    assert peers.peers["b"].demand == {}


def test_prompts_placed_on_the_estimate_travel_with_the_next_report_bounded() -> None:
    sync = sync_of(board_of("i-1"))
    sync.sent("i-1", list(range(MAX_CHAIN_BLOCKS + 10)))  # a huge prompt: its head
    for _ in range(MAX_CHAINS + 5):
        sync.sent("i-1", [1, 2, 3])
    assert len(sync._chains) == MAX_CHAINS
    assert len(sync._chains[0][1]) == MAX_CHAIN_BLOCKS
    assert sync.chains_dropped._value.get() == 6
    sync = sync_of(board_of("i-1"))
    for _ in range(5):
        sync.sent("i-1", [2**64 - 1 - k for k in range(MAX_CHAIN_BLOCKS)])  # 20 digits each
    assert sum(len(h) for _, h in sync._chains) == MAX_REPORT_BLOCKS  # the fifth left out
    report = decode(encode("b", {}, {"t": 1.0}, sync._chains))
    assert report is not None and len(encode("b", {}, None, sync._chains)) < MAX_MESSAGE_BYTES
    report = decode(encode("b", {}, None, [("i-1", [2**64 - 1, 0, 7])]))
    assert report is not None and report.chains == [("i-1", [2**64 - 1, 0, 7])]


def test_sessions_placed_travel_with_the_next_report_bounded() -> None:
    sync = sync_of(board_of("i-1"))
    for k in range(MAX_SESSIONS + 3):
        sync.session_placed(2**64 - 1 - k, "i-1")
    assert len(sync._sessions) == MAX_SESSIONS
    assert sync.sessions_dropped._value.get() == 3
    message = encode("b", {}, {"t": 1.0}, [], sync._sessions)
    report = decode(message)
    assert report is not None and report.sessions[:2] == [(2**64 - 1, "i-1"), (2**64 - 2, "i-1")]
    assert len(report.sessions) == MAX_SESSIONS and len(message) < MAX_MESSAGE_BYTES // 16


def test_an_edge_shares_its_readings_within_what_peers_accept() -> None:
    sync = sync_of(board_of("i-1"))
    sync.scraped("i-1", EngineLoad(10**9, 3, 1.7))  # an engine claiming absurd numbers
    sync.scraped("i-1", EngineLoad(10**9, 3, float("nan")))
    report = decode(encode("b", {}, None, readings=sync._readings))
    assert report is not None and report.readings == {"i-1": (1_000_000, 3, 0.0)}  # NaN: 0
    assert sync.readings.labels("scraped")._value.get() == 2


def test_a_peers_reading_of_an_engine_stands_in_for_this_edges_scrape() -> None:
    board = board_of("i-1")
    peers = peers_of(board)
    board.loads["i-1"].admit(100)  # this edge's own, sent before the peer's reading
    report = decode(encode("b", {}, None, readings={"i-1": (3, 2, 0.5), "gone": (1, 1, 0.1)}))
    assert report is not None and report.readings["i-1"] == (3, 2, 0.5)
    assert peers.read(report.readings, 10.0) == 1  # "gone" is not an instance here
    load = board.loads["i-1"]
    assert (load.shared_at, load.scraped_at) == (10.0, 10.0)
    # The engine's own count (its running and waiting) replaces what was sent before it; the
    # requests known in flight remain a floor.
    assert load.snapshot() == (5, 2, 0.5)
    load.admit(100)
    assert load.snapshot()[0] == 6


def test_malformed_or_oversized_messages_are_refused() -> None:
    good = {"p": "b", "i": {"i-1": [1, 0, 10, 1]}}
    assert decode(orjson.dumps(good)) == ("b", {"i-1": (1, 0, 10, 1)}, None, [], [], {})
    for bad in (
        b"not json",
        b"[]",
        orjson.dumps({"p": "", "i": {}}),
        orjson.dumps({"p": "b", "i": {"i-1": [1, 0, 10]}}),
        orjson.dumps({"p": "b", "i": {"i-1": [1, -1, 10, 1]}}),
        orjson.dumps({"p": "b", "i": {"i-1": [1, 0, 1.5, 1]}}),
        orjson.dumps({"p": "b", "i": {"i-1": [True, 0, 1, 1]}}),
        orjson.dumps({"p": "b", "i": {}, "f": True}),
        orjson.dumps({"p": "b", "i": {}, "x": [["i-1", [-1]]]}),
        orjson.dumps({"p": "b", "i": {}, "x": [["i-1", [1.5]]]}),
        orjson.dumps({"p": "b", "i": {}, "x": [["i-1", list(range(MAX_CHAIN_BLOCKS + 1))]]}),
        orjson.dumps({"p": "b", "i": {}, "x": [["i-1", [1]]] * (MAX_CHAINS + 1)}),
        orjson.dumps({"p": "b", "i": {}, "x": [[1, [1]]]}),
        b'{"p":"b","i":{},"s":[[18446744073709551616,"i-1"]]}',  # 2**64: past the hashes
        orjson.dumps({"p": "b", "i": {}, "s": [[-1, "i-1"]]}),
        orjson.dumps({"p": "b", "i": {}, "s": [["7", "i-1"]]}),
        orjson.dumps({"p": "b", "i": {}, "s": [[7, 1]]}),
        orjson.dumps({"p": "b", "i": {}, "e": {"i-1": [1, 0]}}),
        orjson.dumps({"p": "b", "i": {}, "e": {"i-1": [1, -1, 0.5]}}),
        orjson.dumps({"p": "b", "i": {}, "e": {"i-1": [1, 0, 1.5]}}),
        orjson.dumps({"p": "b", "i": {}, "e": {"i-1": [1.0, 0, 0.5]}}),
        orjson.dumps({"p": "b", "i": {}, "e": [["i-1", 1, 0, 0.5]]}),
        orjson.dumps(
            {"p": "b", "i": {}, "e": {f"i-{k}": [0, 0, 0] for k in range(MAX_READINGS + 1)}}
        ),
        orjson.dumps({"p": "b", "i": {}, "s": [[7, "i-1"]] * (MAX_SESSIONS + 1)}),
        orjson.dumps({"p": "b", "i": {}, "f": True, "d": {"acme": -1.0}}),
        orjson.dumps({"p": "b", "i": {}, "f": True, "d": {"acme": "many"}}),
        orjson.dumps({"p": "b", "i": {}, "f": True, "d": [1.0]}),
        orjson.dumps(
            {"p": "b", "i": {}, "f": True, "d": {f"t{k}": 1 for k in range(MAX_DEMANDS + 1)}}
        ),
        orjson.dumps({"p": "b", "i": {f"i-{k}": [0] * 4 for k in range(MAX_REPORT_INSTANCES + 1)}}),
        orjson.dumps({"p": "b", "i": {"i-1": [1, 0, 10, MAX_TOTAL + 1]}}),
        b'{"p":"b","i":{}}' + b" " * MAX_MESSAGE_BYTES,
    ):
        assert decode(bad) is None, bad[:60]


# ---------------------------------------------------------------- rate-limit shares by demand


def limited_table(edges: int) -> RoutingTable:
    doc = {
        "schema_version": 5,
        "version": 1,
        "region": "r1",
        "generated_at": "2026-12-01T00:00:00Z",
        "instances": [],
        "remote_regions": [],
        "local_edges": edges,
        "tenants": [
            {"tenant": "acme", "key_hashes": ["a" * 64], "allowed_regions": ["r1"],
             "requests_per_s": 10.0},
            {"tenant": "free", "key_hashes": ["b" * 64], "allowed_regions": ["r1"]},
        ],
    }  # fmt: skip
    return decode_table(orjson.dumps(doc))


def test_demand_is_the_rate_of_requests_reaching_the_limits_admitted_or_not() -> None:
    admission = Admission("r1")
    admission.load(limited_table(2), 0.0)
    acme = admission.by_hash["a" * 64]
    meter = DemandMeter()
    assert meter.update(admission.limited(), 0.0) == {}
    for second in range(1, 9):
        acme.asked += 20  # 20 requests/s, most of them refused: demand all the same
        demand = meter.update(admission.limited(), float(second))
    assert 19.0 < demand["acme"] <= 20.0
    assert "free" not in demand  # no limit, no share to give
    for second in range(9, 20):
        demand = meter.update(admission.limited(), float(second))
    assert demand == {}  # gone quiet


def test_shares_follow_the_demand_and_every_edge_computes_a_sum_of_one() -> None:
    a, b, c = {"acme": 9.0}, {"acme": 1.0}, dict[str, float]()
    shares = [
        demand_shares(a, [b, c], 3)["acme"],
        demand_shares(b, [a, c], 3)["acme"],
        demand_shares(c, [a, b], 3).get("acme", 0.0),
    ]
    floor = SHARE_FLOOR / 3
    assert shares == pytest.approx([floor + 0.8 * 0.9, floor + 0.8 * 0.1, floor], abs=1e-3)
    assert sum(shares) == pytest.approx(1.0, abs=2e-3)
    assert demand_shares({}, [{}], 2) == {}  # no demand anywhere: 1/n stays


def test_a_share_rerates_the_tenants_buckets_and_a_new_table_keeps_it() -> None:
    admission = Admission("r1", burst_s=2.0)
    admission.load(limited_table(2), 0.0)
    acme = admission.by_hash["a" * 64]
    assert acme.requests is not None and acme.requests.rate == 5.0  # 1/2 of 10
    admission.reshare({"acme": 0.9}, 1.0)
    assert acme.requests.rate == 9.0 and acme.requests.capacity == 18.0
    admission.load(limited_table(2), 2.0)
    acme = admission.by_hash["a" * 64]
    assert acme.requests is not None and acme.requests.rate == 9.0
    admission.reshare({}, 3.0)  # the peers went silent: back to 1/n
    assert acme.requests.rate == 5.0


def test_two_edges_never_give_a_tenant_more_than_its_limit_as_its_traffic_moves() -> None:
    """The shares are computed from published demand only, on every report: once a report has
    arrived the edges' rates add up to the limit, while the traffic moves from one edge to
    the other and back (not only at the next tick of each edge)."""
    syncs: list[PeerSync] = []
    for me in ("a", "b"):
        admission = Admission("r1")
        admission.load(limited_table(2), 0.0)
        board = board_of()
        peers = PeerLoads(board, me, lambda _i: RATE, lambda _i, _n: None, capacity_in(board))
        syncs.append(
            PeerSync("redis://unused", "r1", peers, CollectorRegistry(), admission, keys=KEYS)
        )
    a, b = syncs

    def rates() -> float:
        total = 0.0
        for sync in syncs:
            assert sync.admission is not None
            bucket = sync.admission.by_hash["a" * 64].requests
            assert bucket is not None
            total += bucket.rate
        return total

    def publish(src: PeerSync, dst: PeerSync, now: float) -> None:
        demand = src._measure(now)
        src._demand = demand  # published: the source reshares (as in its loop), and ...
        src._share(now)
        src.seq += 1
        report = encode(src.peers.me, {}, demand)
        dst._receive(seal(KEYS, src.peers.me, src.seq, src.clock_ms(), report))  # ... the peer
        assert rates() <= 10.0 * 1.002

    publish(a, b, 0.0)
    publish(b, a, 0.0)
    now = 0.0
    for where in [a] * 12 + [b] * 12 + [a, b] * 6:
        now += 0.25
        assert where.admission is not None
        where.admission.by_hash["a" * 64].asked += 5  # 20 requests/s arriving there
        publish(a, b, now)
        publish(b, a, now + 0.1)
    assert rates() == pytest.approx(10.0, rel=2e-3)


def test_shares_step_towards_their_targets_together_and_leave_at_one_over_n() -> None:
    a: dict[str, float] = {}
    b: dict[str, float] = {}
    for _ in range(40):
        # a's report came first: for one report a sees the tenant as all its own.
        a = step_shares(a, demand_shares({"acme": 8.0}, [{}], 2), 0.5)
        b = step_shares(b, demand_shares({}, [{"acme": 8.0}], 2), 0.5)
        assert a["acme"] + b["acme"] == pytest.approx(1.0, abs=2e-4)
        a = step_shares(a, demand_shares({"acme": 8.0}, [{"acme": 8.0}], 2), 0.5)
        b = step_shares(b, demand_shares({"acme": 8.0}, [{"acme": 8.0}], 2), 0.5)
        assert a.get("acme", 0.5) + b.get("acme", 0.5) == pytest.approx(1.0, abs=2e-4)
    # One step of the odd phase moves a share by a fifth of the gap, not all the way to 0.9.
    assert step_shares({}, {"acme": 0.9}, 0.5) == {"acme": 0.58}
    assert step_shares({"acme": 0.5005}, {}, 0.5) == {}  # back at 1/n: left out


def test_a_report_carries_the_busiest_tenants_demand_within_what_peers_accept() -> None:
    demand = {f"t{k}": float(k) for k in range(MAX_DEMANDS + 10)}
    carried = busiest(demand)
    assert len(carried) == MAX_DEMANDS and "t0" not in carried and f"t{MAX_DEMANDS + 9}" in carried
    assert decode(encode("b", {}, carried)) is not None
    assert busiest({"acme": 1.0}) == {"acme": 1.0}


def test_peer_sync_stops_when_a_change_and_the_stop_come_together() -> None:
    """A board change wakes the publishing loop in the very step the edge stops it: the stop
    must still end it. With ``asyncio.wait_for`` (Python 3.11) the cancellation was lost, the
    loop went on publishing, and an edge worker never exited on SIGTERM."""

    async def main() -> None:
        sync = PeerSync(
            "redis://127.0.0.1:1/0", "r1", peers_of(board_of()), CollectorRegistry(), keys=KEYS
        )
        sync.start()
        await asyncio.sleep(0.05)  # both loops are waiting now
        sync._changed.set()
        async with asyncio.timeout(5):
            await sync.stop()

    asyncio.run(main())
