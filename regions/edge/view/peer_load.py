"""Live load shared by a region's edges: each publishes what it sends to every instance, and
each adds what the others sent to its own counts (``load.py``).

Why: an edge counts its own requests the instant it sends them, but another edge's only at the
next scrape of the engine's ``/metrics`` (every 0.5 s). At ~90 % load, two or three edges behind
a per-request balancer then send bursts to the instance that looked free, and queue at their
gateways for slots already freed elsewhere (``docs/benchmarks.md`` §2). Dynamo's KV router
replicas share their in-flight requests the same way, beside the KV events that already give
every edge the same prefix view.

What crosses, per instance: this edge's running totals of requests sent and ended and of
uncached prompt tokens sent, and its requests in flight; its readings of the engines'
``/metrics`` (the others skip their own scrape while one is fresh, so an engine is not scraped
once per edge); the sessions it placed on a new instance (so a session's next turn stays there
whichever edge it reaches) and, on the byte estimate, where its prompts went. Totals make a
lost or late message harmless (the next one carries the difference); in-flight counts are
replaced, not added. A peer silent for :data:`EXPIRE_S` is dropped (its in-flight no longer
counted) and the scrapes alone carry its load again, as with Redis away;
``fedinfer_edge_peers`` shows how many are counted. Transport: the region's Redis, pub/sub
channel ``fedinfer:edge-load:<db>:<region>``, each report signed with the region's peer key
(``peer_auth.py``).

What a report may do is bounded whoever sent it: only instances of the current table count
(the rest of a report is ignored), a peer's in-flight at an instance is at most the
instance's ``max_concurrency``, what it sent or ended there since its last report at most
:data:`DELTA_PER_SLOT` per slot, at most :data:`MAX_PEERS` peers are counted, and a peer
that goes silent frees its slots with one call per instance (``on_freed(instance, n)``).

:class:`PeerLoads` folds reports in, :class:`DemandMeter` and :func:`demand_shares` set the
rate-limit shares; all pure. Their I/O is ``peer_sync.py``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import orjson

from regions.edge.policy.admission import TenantState
from regions.edge.policy.peer_auth import MAX_AGE_MS, MAX_SKEW_MS
from regions.edge.view.load import LoadBoard
from regions.engines.metrics import EngineLoad
from regions.tables.schema import MAX_LOCAL_EDGES

log = logging.getLogger("fedinfer.edge.peers")

#: A message at least this often, so silence means a peer is gone.
HEARTBEAT_S = 0.25
#: A peer not heard from for this long is no longer counted.
EXPIRE_S = 1.0
#: Larger messages are refused unread; a sender leaves its prompts out of a report rather
#: than exceed it (``peer_sync.py``).
MAX_MESSAGE_BYTES = 1024 * 1024
#: Demand's averaging time: how fast a tenant's share follows its requests to another edge.
DEMAND_TAU_S = 1.0
#: Below this many requests/s a tenant's demand is left out of the report.
MIN_DEMAND = 0.01
#: The part of its equal share (1/n of a limit) an edge keeps whatever the demand, so a
#: tenant's first requests at an edge it had not used are not refused while demand catches up.
SHARE_FLOOR = 0.2
#: How far a tenant's share moves towards its target on each report: the edges move together
#: (the shares keep summing to 1) but gradually, so a phase difference between the edges'
#: reports does not shrink a bucket (and clip what it held) only to grow it again.
SHARE_STEP = 0.2
#: Requests/s a report may claim for one tenant (anything above is malformed).
MAX_DEMAND = 1e6
#: Tenants a report may carry demand for (a longer report is malformed); an edge with more
#: in demand reports the busiest (``peer_sync.PeerSync._measure``).
MAX_DEMANDS = 16_384
#: One instance's counts in a message: sent, ended, uncached tokens sent, in flight.
Counts = tuple[int, int, int, int]
#: A prompt's block hashes (``prefix_index.py``) and the instance it was sent to.
Chain = tuple[str, list[int]]
#: Blocks of one prompt shared with the peers (its first 128 KiB at 64 bytes a block): the
#: head of a longer one is what other prompts share with it.
MAX_CHAIN_BLOCKS = 2048
#: Prompts per report, and their blocks in all (~170 KiB of hashes at most); beyond, until
#: the next report, the peers do not hear of them (counted).
MAX_CHAINS = 64
MAX_REPORT_BLOCKS = 8192
#: An engine's load as an edge scraped it: requests running, waiting, KV-cache usage (0..1).
Reading = tuple[int, int, float]
#: Readings per report (instances of a region); beyond, the peers scrape those themselves.
MAX_READINGS = 1024
#: A count in a reading above this is malformed.
MAX_READING_COUNT = 1_000_000
#: Instances per report (a region's instances, as for readings); a longer report is malformed.
MAX_REPORT_INSTANCES = MAX_READINGS
#: A running total above this is malformed (a 64-bit signed counter never gets there).
MAX_TOTAL = (1 << 63) - 1
#: Requests a peer may say it sent (or saw end) at one instance between two of its reports,
#: per slot of the instance (its ``max_concurrency``): reports come every few ms to
#: :data:`EXPIRE_S` apart, so each slot would turn over 64 times a second; more is clamped.
DELTA_PER_SLOT = 64
#: Uncached prompt tokens one request may add to an instance's pending prefill (a 1M-token
#: context); more is clamped.
MAX_UNCACHED_PER_REQUEST = 1 << 20
#: Other edge processes of a region counted at most (the table's most: ``local_edges``); a
#: new one past it is refused (counted) until one goes silent.
MAX_PEERS = MAX_LOCAL_EDGES
#: How long a peer's last sequence number is kept after it was last heard: past the age a
#: signed message may have (``peer_auth.MAX_AGE_MS``), so none of its messages can be replayed.
SEQ_MEMORY_S = (MAX_AGE_MS + MAX_SKEW_MS) / 1000.0 + EXPIRE_S
#: A session key (``sessions.session_key``) and the instance an edge placed it on.
Placed = tuple[int, str]
#: Sessions placed per report (~20 KiB); beyond, until the next report, the peers do not hear
#: of them (counted) and fall back to the session's home.
MAX_SESSIONS = 512


def board_counts(board: LoadBoard) -> dict[str, Counts]:
    """This edge's totals for every instance it has sent to."""
    return {
        inst: (load.sent_total, load.ended_total, load.uncached_total, load.inflight)
        for inst, load in board.loads.items()
        if load.sent_total
    }


def encode(
    peer: str,
    counts: Mapping[str, Counts],
    demand: Mapping[str, float] | None = None,
    chains: Sequence[Chain] = (),
    sessions: Sequence[Placed] = (),
    readings: Mapping[str, Reading] | None = None,
) -> bytes:
    """A report. With ``demand`` it is a full one (every instance sent to, and the demand per
    tenant: every :data:`HEARTBEAT_S`); without, only the instances whose counts changed.
    ``chains``: the prompts' block hashes sent to each instance since the last report;
    ``sessions``: the sessions placed on a new instance since then; ``readings``: the engines
    it scraped since then."""
    doc: dict[str, object] = {"p": peer, "i": counts}
    if demand is not None:
        doc["d"] = demand
        doc["f"] = True
    if chains:
        doc["x"] = chains
    if sessions:
        doc["s"] = sessions
    if readings:
        doc["e"] = readings
    return orjson.dumps(doc)


class Report(NamedTuple):
    peer: str
    counts: dict[str, Counts]
    #: Tenant slug → requests/s reaching this edge's rate limits (admitted or not); None in a
    #: report of changes only (the last full report's stands).
    demand: dict[str, float] | None
    #: The prompts' block hashes the peer sent and to which instance (byte-estimate path).
    chains: list[Chain]
    #: The sessions the peer placed on a new instance (it keeps them there).
    sessions: list[Placed]
    #: The engines the peer scraped since its last report (in place of this edge's scrape).
    readings: dict[str, Reading]


def decode(data: bytes | memoryview) -> Report | None:
    """A peer's report, or None for anything malformed."""
    if len(data) > MAX_MESSAGE_BYTES:
        return None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    peer, body = doc.get("p"), doc.get("i")
    if not isinstance(peer, str) or not 0 < len(peer) <= 128 or not isinstance(body, dict):
        return None
    out = _counts(body)
    chains = _chains(doc.get("x", []))
    sessions = _sessions(doc.get("s", []))
    readings = _readings(doc.get("e", {}))
    if out is None or chains is None or sessions is None or readings is None:
        return None
    if doc.get("f") is not True:
        return Report(peer, out, None, chains, sessions, readings)
    raw_demand = doc.get("d")
    if not isinstance(raw_demand, dict) or len(raw_demand) > MAX_DEMANDS:
        return None
    demand: dict[str, float] = {}
    for slug, rate in raw_demand.items():
        if type(rate) not in (int, float) or not 0.0 <= rate <= MAX_DEMAND:
            return None
        demand[slug] = float(rate)
    return Report(peer, out, demand, chains, sessions, readings)


def _counts(body: dict[str, object]) -> dict[str, Counts] | None:
    if len(body) > MAX_REPORT_INSTANCES:
        return None
    out: dict[str, Counts] = {}
    for inst, counts in body.items():
        if (
            not isinstance(counts, list)
            or len(counts) != 4
            or not all(type(n) is int and 0 <= n <= MAX_TOTAL for n in counts)
        ):
            return None
        out[inst] = (counts[0], counts[1], counts[2], counts[3])
    return out


def _chains(raw: object) -> list[Chain] | None:
    if not isinstance(raw, list) or len(raw) > MAX_CHAINS:
        return None
    chains: list[Chain] = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 2:
            return None
        inst, hashes = item
        if not isinstance(inst, str) or not isinstance(hashes, list):
            return None
        if len(hashes) > MAX_CHAIN_BLOCKS or not all(
            type(h) is int and 0 <= h < 1 << 64 for h in hashes
        ):
            return None
        chains.append((inst, hashes))
    return chains


def _sessions(raw: object) -> list[Placed] | None:
    if not isinstance(raw, list) or len(raw) > MAX_SESSIONS:
        return None
    placed: list[Placed] = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 2:
            return None
        key, inst = item
        if type(key) is not int or not 0 <= key < 1 << 64 or not isinstance(inst, str):
            return None
        placed.append((key, inst))
    return placed


def _readings(raw: object) -> dict[str, Reading] | None:
    if not isinstance(raw, dict) or len(raw) > MAX_READINGS:
        return None
    readings: dict[str, Reading] = {}
    for inst, reading in raw.items():
        if not isinstance(reading, list) or len(reading) != 3:
            return None
        running, waiting, kv = reading
        if not all(type(n) is int and 0 <= n <= MAX_READING_COUNT for n in (running, waiting)):
            return None
        if type(kv) not in (int, float) or not 0.0 <= kv <= 1.0:
            return None
        readings[inst] = (running, waiting, float(kv))
    return readings


@dataclass(slots=True)
class Peer:
    seen_at: float
    counts: dict[str, Counts] = field(default_factory=dict)
    demand: dict[str, float] = field(default_factory=dict)


class PeerLoads:
    """The other edges' last reports, folded into the load board.

    ``rate_of(instance)``: its prefill tokens/s as the scheduler uses it (drains the pending
    prefill); ``capacity_of(instance)``: its ``max_concurrency`` in the current table, None
    for an instance not in it (ignored); ``on_freed(instance, n)``: ``n`` of the peers'
    requests there ended (wakes up to ``n`` gateway waiters).
    """

    def __init__(
        self,
        board: LoadBoard,
        me: str,
        rate_of: Callable[[str], float],
        on_freed: Callable[[str, int], None],
        capacity_of: Callable[[str], int | None],
    ) -> None:
        self.board = board
        self.me = me
        self.rate_of = rate_of
        self.on_freed = on_freed
        self.capacity_of = capacity_of
        self.peers: dict[str, Peer] = {}
        #: Peer id → (its last sequence number accepted, when): kept :data:`SEQ_MEMORY_S`
        #: after the peer was last heard, so none of its messages is applied twice.
        self._seqs: dict[str, tuple[int, float]] = {}

    def accept(self, peer_id: str, seq: int, now: float) -> str | None:
        """Whether a verified message (``peer_auth.open_sealed``) may be applied: None, its
        sequence number then recorded; else why not (``replayed``: not newer than the last
        one of that peer; ``too_many_peers``: a new peer past :data:`MAX_PEERS`)."""
        last = self._seqs.get(peer_id)
        if last is not None and seq <= last[0]:
            return "replayed"
        if peer_id not in self.peers and (
            len(self.peers) >= MAX_PEERS or (last is None and len(self._seqs) >= 4 * MAX_PEERS)
        ):
            return "too_many_peers"
        self._seqs[peer_id] = (seq, now)
        return None

    def apply(
        self,
        peer_id: str,
        counts: Mapping[str, Counts],
        now: float,
        demand: Mapping[str, float] | None = None,
    ) -> int:
        """A peer's report: add what it sent and ended since its last one, take its in-flight
        (and, in a full report — one with ``demand`` — its demand per tenant). A full report
        replaces what the peer said of every instance; a report of changes updates those.
        Instances not in the table are left out, counts past the instance's bounds clamped;
        the number of counts clamped (a well-behaved peer's: 0)."""
        if peer_id == self.me:
            return 0
        known, clamped = self._bounded(counts)
        peer = self.peers.get(peer_id)
        if peer is None:
            if len(self.peers) >= MAX_PEERS:
                return clamped
            # Unknown (new, or expired and back): its totals so far are the baseline; what they
            # covered is in the engines' next scrape already.
            self.peers[peer_id] = Peer(now, known, dict(demand or {}))
            self._recount(known)
            return clamped
        peer.seen_at = now
        old = peer.counts
        if demand is None:
            peer.counts = {**old, **known}
            changed: Iterable[str] = known.keys()
        else:
            peer.demand = dict(demand)
            peer.counts = known
            changed = known.keys() | old.keys()
        self._recount(changed)  # first: the pending rule reads in-flight
        loads = self.board.loads
        for inst, (sent, ended, uncached, _) in known.items():
            load = loads.get(inst)
            before = old.get(inst)
            if load is None or before is None:
                continue
            d_sent, d_ended, d_unc = sent - before[0], ended - before[1], uncached - before[2]
            if d_sent < 0 or d_ended < 0 or d_unc < 0:
                continue  # totals went down: the peer restarted its count; new baseline
            most = DELTA_PER_SLOT * (self.capacity_of(inst) or 1)
            if d_sent > most or d_ended > most:
                clamped += 1
                d_sent, d_ended = min(d_sent, most), min(d_ended, most)
            if d_unc > d_sent * MAX_UNCACHED_PER_REQUEST:
                clamped += 1
                d_unc = d_sent * MAX_UNCACHED_PER_REQUEST
            if d_sent or d_ended:
                load.peers_sent(d_sent, d_ended, d_unc, now, self.rate_of(inst))
        return clamped

    def _bounded(self, counts: Mapping[str, Counts]) -> tuple[dict[str, Counts], int]:
        """The counts of the table's instances, in-flight clamped to each one's slots; and
        how many were clamped."""
        capacity_of = self.capacity_of
        known: dict[str, Counts] = {}
        clamped = 0
        for inst, c in counts.items():
            cap = capacity_of(inst)
            if cap is None:
                continue
            if c[3] > cap:
                clamped += 1
                c = (c[0], c[1], c[2], cap)
            known[inst] = c
        return known, clamped

    def read(self, readings: Mapping[str, Reading], now: float) -> int:
        """A peer's readings of the engines, taken as this edge's own scrapes; how many were
        of instances this edge knows (of the table: the rest are ignored)."""
        loads = self.board.loads
        capacity_of = self.capacity_of
        used = 0
        for inst, (running, waiting, kv) in readings.items():
            load = loads.get(inst)
            if load is not None and capacity_of(inst) is not None:
                load.shared(EngineLoad(running, waiting, kv), now)
                used += 1
        return used

    def expire(self, now: float) -> int:
        """Drop peers silent for :data:`EXPIRE_S`; the number still counted."""
        gone = [pid for pid, p in self.peers.items() if now - p.seen_at > EXPIRE_S]
        for pid in gone:
            counts = self.peers.pop(pid).counts
            log.info("edge peer %s silent for %.1f s: no longer counted", pid, EXPIRE_S)
            self._recount(counts)
        seqs = self._seqs
        for pid in [pid for pid, (_, at) in seqs.items() if now - at > SEQ_MEMORY_S]:
            if pid not in self.peers:
                del seqs[pid]
        return len(self.peers)

    def _recount(self, instances: Iterable[str]) -> None:
        """Each instance's in-flight at the peers, summed again (replaced, never drifting);
        slots freed are told once per instance, however many."""
        loads = self.board.loads
        for inst in instances:
            load = loads.get(inst)
            if load is None:
                continue
            total = 0
            for p in self.peers.values():
                c = p.counts.get(inst)
                if c is not None:
                    total += c[3]
            freed = load.peer_inflight - total
            load.peer_inflight = total
            if freed > 0:
                self.on_freed(inst, freed)


class DemandMeter:
    """Requests/s reaching this edge's rate limits, per limited tenant: an exponential
    average over :data:`DEMAND_TAU_S` of the count the admission stage keeps."""

    def __init__(self) -> None:
        self.rates: dict[str, float] = {}
        self._seen: dict[str, int] = {}
        self._at: float | None = None

    def update(self, tenants: Iterable[TenantState], now: float) -> dict[str, float]:
        """The demand now (tenants with none left out)."""
        elapsed = 0.0 if self._at is None else now - self._at
        self._at = now
        weight = 1.0 - math.exp(-elapsed / DEMAND_TAU_S) if elapsed > 0 else 0.0
        rates: dict[str, float] = {}
        seen: dict[str, int] = {}
        for state in tenants:
            slug = state.slug
            seen[slug] = state.asked
            before = self._seen.get(slug, state.asked)
            rate = self.rates.get(slug, 0.0)
            if elapsed > 0:
                rate += weight * ((state.asked - before) / elapsed - rate)
            if rate >= MIN_DEMAND:
                rates[slug] = round(rate, 3)
        self._seen = seen
        self.rates = rates
        return rates


def busiest(demand: Mapping[str, float]) -> dict[str, float]:
    """The demand a report carries: every tenant's, or past :data:`MAX_DEMANDS` (more than
    peers accept) the busiest tenants'."""
    if len(demand) <= MAX_DEMANDS:
        return dict(demand)
    ranked = sorted(demand.items(), key=lambda item: item[1], reverse=True)
    return dict(ranked[:MAX_DEMANDS])


def demand_shares(
    own: Mapping[str, float], peers: Iterable[Mapping[str, float]], edges: int
) -> dict[str, float]:
    """Each tenant's share of its limits at this edge: :data:`SHARE_FLOOR` of an equal part,
    the rest in proportion to where its requests arrive. Every edge that sees the same
    demands computes shares that sum to 1 over the ``edges`` (so the region's bound holds).
    A tenant with no demand anywhere is left out (1/n)."""
    totals = dict(own)
    for demand in peers:
        for slug, rate in demand.items():
            totals[slug] = totals.get(slug, 0.0) + rate
    equal = 1.0 / edges
    out: dict[str, float] = {}
    for slug, total in totals.items():
        if total <= 0.0:
            continue
        share = SHARE_FLOOR * equal + (1.0 - SHARE_FLOOR) * own.get(slug, 0.0) / total
        out[slug] = round(share, 3)
    return out


def step_shares(
    current: Mapping[str, float], target: Mapping[str, float], equal: float
) -> dict[str, float]:
    """Each tenant's share moved :data:`SHARE_STEP` of the way to its target (1/n, ``equal``,
    for a tenant left out). Every edge takes the same step on the same report, so shares that
    summed to 1 still do. A share back at 1/n is left out."""
    out: dict[str, float] = {}
    for slug in current.keys() | target.keys():
        goal = target.get(slug, equal)
        share = current.get(slug, equal)
        share += SHARE_STEP * (goal - share)
        if goal == equal and abs(share - equal) < 1e-3:
            continue
        out[slug] = round(share, 4)
    return out
